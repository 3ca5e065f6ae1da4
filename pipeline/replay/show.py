"""One rollout of a replayed ledger as the operator reads it: its calls in tree order,
each with its status, and its receipt's verdict (what ``tokentrail ledger show`` prints)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from topics.records import CallRecord, FailedCall, RolloutReceipt

Ordered = Sequence[tuple[CallRecord | FailedCall, int]]
"""Calls with their depth, as ``pipeline.replay.store.tree_order`` gives them."""


def rollout_document(rollout_id: str, ordered: Ordered, receipt: RolloutReceipt | None) -> dict[str, Any]:
    """The ``--json`` document."""
    return {
        "rollout_id": rollout_id,
        "calls": [call.model_dump(mode="json") for call, _ in ordered],
        "receipt": None if receipt is None else receipt.model_dump(mode="json"),
    }


def print_rollout(rollout_id: str, ordered: Ordered, receipt: RolloutReceipt | None) -> None:
    """The calls as a table indented by depth, then the receipt's verdict."""
    console = Console()
    console.print(calls_table(rollout_id, ordered))
    if receipt is not None:
        console.print(verdict(receipt))


def calls_table(rollout_id: str, ordered: Ordered) -> Table:
    table = Table(title=f"rollout {rollout_id}")
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
    return table


def verdict(receipt: RolloutReceipt) -> str:
    """Whether the rollout's capture holds, per chain when the receipt has chains."""
    state = f"poisoned: {receipt.failure_reason}" if receipt.capture_poisoned else "ok"
    if receipt.chains:
        chains = ", ".join(f"{c.leaf_call_id}: {c.failure_reason or 'ok'}" for c in receipt.chains)
        return f"receipt ({receipt.sample_policy}): chains {chains}; {state}"
    return f"receipt: terminal={receipt.terminal_call_id} ({receipt.terminal_selection}) {state}"
