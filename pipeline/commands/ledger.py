"""``tokentrail ledger show ROLLOUT_ID``: one rollout's calls and receipt from a replayed ledger."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pipeline.replay.store import LedgerStore, tree_order
from topics.records import CallRecord

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
    calls = [call for call, _ in ordered]
    if not calls and receipt is None:
        print(f"tokentrail ledger: rollout {args.rollout_id!r} not in {args.db}", file=sys.stderr)
        return 1
    if args.json:
        document = {
            "rollout_id": args.rollout_id,
            "calls": [c.model_dump(mode="json") for c in calls],
            "receipt": None if receipt is None else receipt.model_dump(mode="json"),
        }
        print(json.dumps(document, sort_keys=True))
        return 0
    table = Table(title=f"rollout {args.rollout_id}")
    for column in ("call", "parent", "status", "prev_len", "delta_len", "weight_version"):
        table.add_column(column)
    for call, depth in ordered:
        name = "  " * depth + call.call_id
        if isinstance(call, CallRecord):
            table.add_row(
                name,
                call.parent_call_id or "-",
                "committed",
                str(call.prev_len),
                str(call.delta_len),
                str(call.weight_version),
            )
        else:
            table.add_row(name, call.parent_call_id or "-", f"failed: {call.reason}", "", "", "")
    console = Console()
    console.print(table)
    if receipt is not None:
        verdict = f"poisoned: {receipt.failure_reason}" if receipt.capture_poisoned else "ok"
        if receipt.chains:
            chains = ", ".join(f"{c.leaf_call_id}: {c.failure_reason or 'ok'}" for c in receipt.chains)
            console.print(f"receipt ({receipt.sample_policy}): chains {chains}; {verdict}")
        else:
            console.print(
                f"receipt: terminal={receipt.terminal_call_id} ({receipt.terminal_selection}) {verdict}"
            )
    return 0
