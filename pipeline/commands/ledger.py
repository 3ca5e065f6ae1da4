"""``tokentrail ledger show ROLLOUT_ID``: one rollout's calls and receipt from a replayed ledger."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pipeline.replay.show import print_rollout, rollout_document
from pipeline.replay.store import LedgerStore, tree_order

EXAMPLES = """\
examples:
  tokentrail replay --bootstrap 127.0.0.1:9092 --out ledger.sqlite
  tokentrail ledger show r-42 --db ledger.sqlite
  tokentrail ledger show r-42 --db ledger.sqlite --json
"""


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "ledger",
        help="inspect a ledger built by 'tokentrail replay'",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verbs = parser.add_subparsers(dest="ledger_verb", required=True)
    show = verbs.add_parser("show", help="print one rollout's calls and receipt")
    show.add_argument("rollout_id", help="the rollout to show")
    show.add_argument("--db", type=Path, default=Path(".tokentrail/ledger.sqlite"), help="ledger SQLite file")
    show.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    show.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not args.db.exists():
        print(
            f"tokentrail ledger: no ledger at {args.db}; run 'tokentrail replay --out {args.db}'",
            file=sys.stderr,
        )
        return 2
    with LedgerStore(args.db) as store:
        found, receipt = store.rollout(args.rollout_id)
    ordered = tree_order(found)
    if not ordered and receipt is None:
        print(f"tokentrail ledger: rollout {args.rollout_id!r} not in {args.db}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(rollout_document(args.rollout_id, ordered, receipt), sort_keys=True))
    else:
        print_rollout(args.rollout_id, ordered, receipt)
    return 0
