"""Terminal selection (DESIGN §4.4) and the chains that become samples.

Given the committed calls of a rollout, pick the call whose chain becomes the sample:
the one the seal declares, or else the unique leaf once failed calls, abandoned
retries (childless siblings of an extended call) and superseded attempts of one
logical call are set aside. Under a multi-sample policy, pick every chain's leaf.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from topics.failures import LedgerFailure
from topics.records import CallRecord, RolloutSeal, SamplePolicy

Selection = Literal["declared", "unique_leaf"]


@dataclass(frozen=True, slots=True)
class Terminal:
    call_id: str
    selection: Selection


class NoTerminal(Exception):
    def __init__(self, code: LedgerFailure, detail: str) -> None:
        super().__init__(f"{code.value}: {detail}")
        self.code = code
        self.detail = detail


def select_terminal(
    records: Mapping[str, CallRecord], seal: RolloutSeal, parents: Mapping[str, str | None] | None = None
) -> Terminal:
    """The terminal call of a rollout; ``records`` are its committed calls by id.

    ``parents`` gives the parent of every other known call (failed ones, and parents
    nobody admitted), so the tree keeps its shape where such a call was extended. A
    failed leaf drops only when a sibling that got somewhere survives (it was retried,
    and the retry was served); when every attempt of a turn failed, one of them is the
    real end of the episode and is returned, for the caller to reject.
    """
    if seal.terminal_call_id is not None or seal.terminal_response_id is not None:
        return _declared(records, seal)
    leaves = _surviving_leaves(_tree(records, parents), records, keep_branches=False)
    if len(leaves) == 1:
        return Terminal(leaves[0], "unique_leaf")
    raise NoTerminal(LedgerFailure.AMBIGUOUS_TERMINAL, f"{len(leaves)} leaves: {', '.join(leaves[:5])}")


def select_chains(
    records: Mapping[str, CallRecord], policy: SamplePolicy, parents: Mapping[str, str | None] | None = None
) -> list[str]:
    """The leaves whose root-to-leaf chains become samples under a multi-sample policy.

    ``leaves``: every surviving leaf. A served call nobody extended is a branch here, not
    an abandoned retry; retries collapse through their shared ``logical_call_id`` and
    failed attempts as for the terminal. ``chains``: per root (a rewritten history
    starts a new one), the leaf that ends its longest chain, in tokens (then call id),
    after the terminal's rules set abandoned retries aside.
    """
    tree = _tree(records, parents)
    leaves = _surviving_leaves(tree, records, keep_branches=policy == "leaves", keep_roots=policy == "chains")
    if policy != "chains":
        return leaves
    by_root: dict[str, list[str]] = defaultdict(list)
    for leaf in leaves:
        by_root[tree.root_of(leaf)].append(leaf)
    return sorted(max(group, key=lambda c: (_length(records, c), c)) for group in by_root.values())


@dataclass(frozen=True, slots=True)
class _Tree:
    parent_of: dict[str, str | None]
    children: dict[str | None, list[str]]

    def root_of(self, call_id: str) -> str:
        seen: set[str] = set()
        while (parent := self.parent_of.get(call_id)) is not None and call_id not in seen:
            seen.add(call_id)
            call_id = parent
        return call_id


def _tree(records: Mapping[str, CallRecord], parents: Mapping[str, str | None] | None) -> _Tree:
    if not records and not parents:
        raise NoTerminal(LedgerFailure.NO_CALLS, "no committed call")
    parent_of: dict[str, str | None] = {
        **(parents or {}),
        **{c: r.parent_call_id for c, r in records.items()},
    }
    children: dict[str | None, list[str]] = defaultdict(list)
    for call_id, parent in parent_of.items():
        children[parent].append(call_id)
    return _Tree(parent_of, children)


def _surviving_leaves(
    tree: _Tree, records: Mapping[str, CallRecord], *, keep_branches: bool, keep_roots: bool = False
) -> list[str]:
    """Leaves once retries collapse (DESIGN §4.4); ``keep_branches`` keeps childless
    served siblings of an extended call, which the terminal rule sets aside as abandoned;
    ``keep_roots`` keeps childless roots beside an extended one (under ``chains`` each root
    is a segment of a rewritten history, and a one-call segment is no abandoned retry).

    Set algebra over the parent map rather than a walk of each call's children: this
    runs once per closed rollout, and most rollouts have no failed call at all."""
    parent_of, children = tree.parent_of, tree.children
    dropped = _superseded(records, children)
    if not keep_branches:
        dropped |= _abandoned(tree, keep_roots=keep_roots)
    uncommitted = [c for c in parent_of if c not in records]  # failed, or nobody admitted them
    while True:  # a failed leaf that was retried drops, which can expose its failed parent
        alive = parent_of.keys() - dropped
        extended = {parent_of[c] for c in alive}
        failed = {c for c in uncommitted if c in alive and c not in extended}
        retried = {c for c in failed if any(s in alive and s not in failed for s in children[parent_of[c]])}
        if not retried:
            break
        dropped |= retried
    # Every surviving attempt of a turn failed: one of them (the greatest id, so that the
    # choice is deterministic) ended the episode.
    for parent in {parent_of[c] for c in failed}:
        attempts = sorted(s for s in children[parent] if s in alive)
        if len(attempts) > 1 and all(s in failed for s in attempts):
            alive -= set(attempts[:-1])
    leaves = sorted(alive - {parent_of[c] for c in alive})
    if not leaves:
        raise NoTerminal(LedgerFailure.COORDS_MISMATCH, "no leaf survives (cyclic parents)")
    return leaves


def _length(records: Mapping[str, CallRecord], call_id: str) -> int:
    """Tokens through ``call_id``; a failed call (no record) ranks below every served one."""
    record = records.get(call_id)
    return -1 if record is None else record.cum_len


def _declared(records: Mapping[str, CallRecord], seal: RolloutSeal) -> Terminal:
    if seal.terminal_call_id is not None:
        if seal.terminal_call_id in records:
            return Terminal(seal.terminal_call_id, "declared")
        raise NoTerminal(
            LedgerFailure.DECLARED_TERMINAL_MISSING, f"call {seal.terminal_call_id} not committed"
        )
    matches = [r.call_id for r in records.values() if r.response_id == seal.terminal_response_id]
    if len(matches) == 1:
        return Terminal(matches[0], "declared")
    raise NoTerminal(
        LedgerFailure.DECLARED_TERMINAL_MISSING,
        f"response {seal.terminal_response_id} matches {len(matches)} calls",
    )


def _abandoned(tree: _Tree, *, keep_roots: bool) -> set[str]:
    """Childless siblings of a call that was extended: retries the driver gave up on
    (roots too, unless ``keep_roots``)."""
    parent_of, children = tree.parent_of, tree.children  # a call has children iff it is a key
    turns = {parent_of[c] for c in children if c is not None and c in parent_of}
    if keep_roots:
        turns.discard(None)
    return {c for c, parent in parent_of.items() if parent in turns and c not in children}


def _superseded(records: Mapping[str, CallRecord], children: Mapping[str | None, list[str]]) -> set[str]:
    """Childless attempts of one logical call, except the last one staged."""
    attempts: dict[str, list[CallRecord]] = defaultdict(list)
    for record in records.values():
        if record.logical_call_id is not None:
            attempts[record.logical_call_id].append(record)
    superseded: set[str] = set()
    for group in attempts.values():
        last = max(group, key=lambda r: (r.staged_at, r.call_id))
        superseded.update(r.call_id for r in group if r is not last and not children.get(r.call_id))
    return superseded


def terminal_chain(records: Mapping[str, CallRecord], terminal: str) -> list[str]:
    """Call ids from the root to ``terminal``; raises when an ancestor is missing or a cycle appears."""
    chain: list[str] = []
    seen: set[str] = set()
    current: str | None = terminal
    while current is not None:
        if current in seen:
            raise NoTerminal(LedgerFailure.COORDS_MISMATCH, f"cyclic parents through {current}")
        record = records.get(current)
        if record is None:
            raise NoTerminal(LedgerFailure.UNKNOWN_ADMISSION, f"ancestor {current} was never admitted")
        seen.add(current)
        chain.append(current)
        current = record.parent_call_id
    chain.reverse()
    return chain
