"""One rollout as a call tree: retries collapsed, chains and the samples they became,
and, for a rejected rollout, its code, what the code means and the call that caused it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from pipeline.replay.store import tree_order
from topics.failures import MEANINGS, FinalizerFailure, LedgerFailure, WorkerFailure
from topics.records import CallRecord, FailedCall, FinalizedEvent, RolloutReceipt

Call = CallRecord | FailedCall
FAMILIES: tuple[type[StrEnum], ...] = (WorkerFailure, LedgerFailure, FinalizerFailure)


@dataclass(frozen=True, slots=True)
class CodeMeaning:
    """A failure code, read from the code table itself (``topics.failures``)."""

    code: str
    family: str
    meaning: str


def code_meaning(code: str) -> CodeMeaning:
    for family in FAMILIES:
        if code in family._value2member_map_:
            return CodeMeaning(code, family.__name__, MEANINGS[code])
    return CodeMeaning(code, "unknown", "not a code of this version (DESIGN §6)")


@dataclass(slots=True)
class CallNode:
    """A call in tree order; the retries it replaced are folded under it."""

    call: Call
    depth: int
    retries: list[Call] = field(default_factory=list)
    caused_rejection: bool = False

    @property
    def failed(self) -> bool:
        return isinstance(self.call, FailedCall)


@dataclass(frozen=True, slots=True)
class ChainView:
    """A root-to-leaf chain and what it became: a sample, or a rejection with its code."""

    leaf_call_id: str
    call_ids: tuple[str, ...]
    sample_key: str | None
    status: str
    code: str | None


@dataclass(frozen=True, slots=True)
class RolloutDetail:
    rollout_id: str
    nodes: list[CallNode]
    chains: list[ChainView]
    receipt: RolloutReceipt | None
    finalized: FinalizedEvent | None
    rejection: CodeMeaning | None


def collapse_retries(calls: Sequence[Call]) -> list[CallNode]:
    """Tree order, with childless attempts of a logical call folded under the attempt kept
    (the last staged, as terminal selection keeps it, DESIGN §4.4)."""
    parents = {call.parent_call_id for call in calls}
    attempts: dict[tuple[str | None, str], list[CallRecord]] = {}
    for call in calls:
        if isinstance(call, CallRecord) and call.logical_call_id is not None:
            attempts.setdefault((call.parent_call_id, call.logical_call_id), []).append(call)
    folded: dict[str, str] = {}
    for group in attempts.values():
        kept = max(group, key=lambda c: (c.staged_at, c.call_id))
        folded.update({c.call_id: kept.call_id for c in group if c is not kept and c.call_id not in parents})
    nodes: list[CallNode] = []
    by_id: dict[str, CallNode] = {}
    for call, depth in tree_order(calls):
        if call.call_id not in folded:
            by_id[call.call_id] = node = CallNode(call, depth)
            nodes.append(node)
    for call in calls:
        if call.call_id in folded:
            by_id[folded[call.call_id]].retries.append(call)
    return nodes


def _chain(leaf: str, parents: dict[str, str | None]) -> tuple[str, ...]:
    path: list[str] = []
    current: str | None = leaf
    while current is not None and current not in path:
        path.append(current)
        current = parents.get(current)
    return tuple(reversed(path))


def chains_of(
    rollout_id: str, calls: Sequence[Call], receipt: RolloutReceipt | None, event: FinalizedEvent | None
) -> list[ChainView]:
    """Which chain became which sample (none before the receipt)."""
    if receipt is None:
        return []
    parents = {call.call_id: call.parent_call_id for call in calls}
    if receipt.chains:
        outcomes = {o.leaf_call_id: o for o in event.samples} if event else {}
        views = []
        for chain in receipt.chains:
            outcome = outcomes.get(chain.leaf_call_id)
            views.append(
                ChainView(
                    chain.leaf_call_id,
                    _chain(chain.leaf_call_id, parents),
                    outcome.sample_key if outcome and outcome.status == "accepted" else None,
                    outcome.status if outcome else "rejected" if chain.failure_reason else "unfinalized",
                    (outcome.rejection_reason if outcome else None) or chain.failure_reason,
                )
            )
        return views
    if receipt.terminal_call_id is None:
        return []
    accepted = event is not None and event.status == "accepted"
    return [
        ChainView(
            receipt.terminal_call_id,
            _chain(receipt.terminal_call_id, parents),
            event.sample_key if accepted and event is not None else None,
            event.status if event else "unfinalized",
            event.rejection_reason if event else receipt.failure_reason,
        )
    ]


def rollout_detail(
    rollout_id: str, calls: Sequence[Call], receipt: RolloutReceipt | None, event: FinalizedEvent | None
) -> RolloutDetail:
    nodes = collapse_retries(calls)
    chains = chains_of(rollout_id, calls, receipt, event)
    code = event.rejection_reason if event and event.status == "rejected" else None
    if code is None and receipt is not None and receipt.capture_poisoned:
        code = receipt.failure_reason
    if code is not None:
        _mark_cause(code, nodes, chains)
    return RolloutDetail(
        rollout_id, nodes, chains, receipt, event, None if code is None else code_meaning(code)
    )


def _mark_cause(code: str, nodes: list[CallNode], chains: list[ChainView]) -> None:
    """The call a rejection is pinned on: a failed call with that code, else the leaf of the
    chain rejected with it. Codes about the whole rollout (no terminal, never sealed) pin none."""
    culprits = {n.call.call_id for n in nodes if isinstance(n.call, FailedCall) and n.call.reason == code}
    if not culprits:
        culprits = {chain.leaf_call_id for chain in chains if chain.code == code}
    for node in nodes:
        node.caused_rejection = node.call.call_id in culprits
