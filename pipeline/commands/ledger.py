"""``tokentrail ledger show ROLLOUT_ID``: one rollout's calls and receipt from a replayed ledger."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pipeline.process.flags import add_flags, from_flags
from pipeline.replay.settings import ShowSettings
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
    add_flags(show, ShowSettings)
    show.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    show.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    settings = from_flags(ShowSettings, args)
    if not settings.db.exists():
        print(
            f"tokentrail ledger: no ledger at {settings.db}; run 'tokentrail replay --out {settings.db}'",
            file=sys.stderr,
        )
        return 2
    with LedgerStore(settings.db) as store:
        found, receipt = store.rollout(settings.rollout_id)
    ordered = tree_order(found)
    if not ordered and receipt is None:
        print(f"tokentrail ledger: rollout {settings.rollout_id!r} not in {settings.db}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(rollout_document(settings.rollout_id, ordered, receipt), sort_keys=True))
    else:
        print_rollout(settings.rollout_id, ordered, receipt)
    return 0
