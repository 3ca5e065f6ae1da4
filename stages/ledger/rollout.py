"""One open rollout in the ledger: its admissions, staged events and seal, and the
rules that turn them into call records and, once sealed, a receipt.

Nothing kept here grows with the rollout's depth: an admission's chain of ancestor keys
is reduced to two fingerprints on arrival (``Admitted``), so an open call costs the
same at call 10 and at call 10,000 (DESIGN §4.6).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from stages.ledger.terminal import NoTerminal, select_chains, select_terminal, terminal_chain
from topics.failures import LedgerFailure, WorkerFailure
from topics.records import (
    CallRecord,
    CaptureAdmission,
    FailedCall,
    HistoryPolicy,
    ManifestEntry,
    Mode,
    ReceiptChain,
    RolloutReceipt,
    RolloutSeal,
    StagedEvent,
    assemble,
    chain_fingerprints,
)

FailureReason = WorkerFailure | LedgerFailure


class Admitted(NamedTuple):
    """An admission as the ledger keeps it: every field but the chain, whose place the
    chain's fingerprints take. Two admissions are equal exactly when these are.

    A named tuple rather than a frozen dataclass: as immutable, and about three times
    cheaper to build, which the ledger does for every admission it reads."""

    call_id: str
    parent_call_id: str | None
    prev_len: int
    mode: Mode
    parent_chain_hash: str | None
    logical_call_id: str | None
    group_id: str | None
    admitted_at: float
    history: HistoryPolicy
    ancestry: bytes
    """Fingerprint of the admission's chain (its ancestors' keys)."""
    lineage: bytes
    """Fingerprint of that chain plus this call's key: a child's ``ancestry``."""

    @classmethod
    def of(cls, admission: CaptureAdmission) -> Admitted:
        ancestry, lineage = chain_fingerprints(admission.staging_chain, admission.staging_key)
        return cls(
            call_id=admission.call_id,
            parent_call_id=admission.parent_call_id,
            prev_len=admission.prev_len,
            mode=admission.mode,
            parent_chain_hash=admission.parent_chain_hash,
            logical_call_id=admission.logical_call_id,
            group_id=admission.group_id,
            admitted_at=admission.admitted_at,
            history=admission.history,
            ancestry=ancestry,
            lineage=lineage,
        )

    def first_difference(self, other: Admitted) -> str | None:
        """The admission field where two differ (the chain's name for the fingerprints)."""
        for name, mine, theirs in zip(self._fields, self, other, strict=True):
            if mine != theirs:
                return "staging_chain" if name in {"ancestry", "lineage"} else name
        return None


@dataclass(slots=True)
class OpenRollout:
    """Everything the ledger holds for one rollout until its receipt is out."""

    rollout_id: str
    admissions: dict[str, Admitted] = field(default_factory=dict)
    staged: dict[str, StagedEvent] = field(default_factory=dict)
    committed: dict[str, CallRecord] = field(default_factory=dict)
    failed: dict[str, FailedCall] = field(default_factory=dict)
    seal: RolloutSeal | None = None
    sealed_logged_at: float = 0.0
    """Log time of the seal event."""
    opened_logged_at: float = 0.0
    """Log time of the rollout's first event."""
    unjoined: set[str] = field(default_factory=set)
    """Calls with an admission or a staged event but not both yet: settled once empty,
    checked after every event without walking the rollout."""
    segments: dict[str, bytes] = field(default_factory=dict)
    """Calls admitted as children under the ``render`` history policy that the worker
    staged as roots (their render did not extend the parent's tokens): a child's
    ``ancestry`` must equal this lineage, not the admission's."""

    def admit(self, admission: Admitted) -> CallRecord | FailedCall | None:
        self.admissions[admission.call_id] = admission
        return self.join(admission.call_id)

    def stage(self, staged: StagedEvent) -> CallRecord | FailedCall | None:
        self.staged[staged.coords.call_id] = staged
        return self.join(staged.coords.call_id)

    def join(self, call_id: str) -> CallRecord | FailedCall | None:
        """Join the admission and staged event of ``call_id`` once both are here."""
        admission = self.admissions.get(call_id)
        staged = self.staged.get(call_id)
        if call_id in self.committed or call_id in self.failed:
            return None
        if admission is None or staged is None:
            self.unjoined.add(call_id)
            return None
        self.unjoined.discard(call_id)
        coords = staged.coords
        if coords.disposition == "capture_failed":
            assert coords.failure_reason is not None
            return self._fail(admission, coords.failure_reason, "capture failed on the worker")
        if _starts_segment(self.rollout_id, admission, staged):
            self.segments[call_id] = chain_fingerprints(None, coords.staging_key)[1]
        else:
            mismatch = _coords_mismatch(self.rollout_id, admission, staged)
            if mismatch is not None:
                return self._fail(admission, LedgerFailure.COORDS_MISMATCH, mismatch)
        # Both halves were validated on decode and checked against each other above,
        # so the joined record is built without validating it a third time.
        record = assemble(
            CallRecord,
            {
                **coords.__dict__,
                "response_id": staged.response_id,
                "logical_call_id": admission.logical_call_id,
                "admitted_at": admission.admitted_at,
                "staged_at": staged.staged_at,
            },
        )
        self.committed[call_id] = record
        return record

    def _fail(self, admission: Admitted, reason: FailureReason, detail: str) -> FailedCall:
        failed = FailedCall(
            rollout_id=self.rollout_id,
            call_id=admission.call_id,
            parent_call_id=admission.parent_call_id,
            reason=reason,
            detail=detail,
        )
        self.failed[admission.call_id] = failed
        return failed

    def settled(self) -> bool:
        """Sealed, every admitted call committed or failed, no staged event waiting for an admission."""
        return self.seal is not None and not self.unjoined

    def close(self, forced: LedgerFailure | None = None) -> tuple[list[FailedCall], RolloutReceipt]:
        """Fail what never settled, check lineage, select the terminal, build the receipt.

        ``forced`` poisons the receipt with that code (a rollout that was never sealed).
        """
        assert self.seal is not None
        late: list[FailedCall] = []
        for call_id, admission in self.admissions.items():
            if call_id not in self.committed and call_id not in self.failed:
                late.append(self._fail(admission, LedgerFailure.NEVER_STAGED, "no staged event within grace"))
        for call_id, staged in self.staged.items():
            if call_id not in self.admissions:
                coords = staged.coords
                failed = FailedCall(
                    rollout_id=self.rollout_id,
                    call_id=call_id,
                    parent_call_id=coords.parent_call_id,
                    reason=LedgerFailure.UNKNOWN_ADMISSION,
                    detail="staged event without an admission",
                )
                self.failed[call_id] = failed
                late.append(failed)
        late += self._demote_broken_lineage()
        return late, self._receipt(forced)

    def _demote_broken_lineage(self) -> list[FailedCall]:
        """A child must continue its parent exactly: chain of keys, length and chain hash."""
        demoted: list[FailedCall] = []
        changed = True
        while changed:
            changed = False
            for call_id, record in list(self.committed.items()):
                parent = self.committed.get(record.parent_call_id or "")
                if parent is None:
                    continue
                admission = self.admissions[call_id]
                lineage = self.segments.get(parent.call_id, self.admissions[parent.call_id].lineage)
                if (
                    admission.ancestry != lineage
                    or record.prev_len != parent.cum_len
                    or admission.parent_chain_hash != parent.chain_hash
                ):
                    del self.committed[call_id]
                    demoted.append(
                        self._fail(admission, LedgerFailure.COORDS_MISMATCH, "does not continue parent")
                    )
                    changed = True
        return demoted

    def _receipt(self, forced: LedgerFailure | None) -> RolloutReceipt:
        assert self.seal is not None
        seal = self.seal
        terminal: str | None = None
        selection = None
        chains: list[ReceiptChain] = []
        reason: FailureReason | None = forced
        if reason is not None:
            pass
        elif seal.status == "failed":
            interrupted = seal.failure_reason == LedgerFailure.INTERRUPTED.value
            reason = LedgerFailure.INTERRUPTED if interrupted else LedgerFailure.ROLLOUT_FAILED
        elif not self.admissions:
            reason = LedgerFailure.NO_CALLS
        else:
            try:
                if seal.sample_policy == "terminal":
                    chosen = select_terminal(self.committed, seal, self._tree_parents())
                    terminal, selection = chosen.call_id, chosen.selection
                    reason = self._chain_failure(chosen.call_id)
                else:
                    chains = self._chains(seal)
                    if not any(chain.cumulative_hash for chain in chains):
                        reason = chains[0].failure_reason
            except NoTerminal as exc:
                reason = exc.code
        return RolloutReceipt(
            rollout_id=self.rollout_id,
            group_id=seal.group_id,
            reward=seal.reward,
            call_rewards=seal.call_rewards,
            manifest=[
                ManifestEntry.of(r)
                for r in sorted(self.committed.values(), key=lambda r: (r.prev_len, r.call_id))
            ],
            failed_calls=sorted(self.failed.values(), key=lambda f: f.call_id),
            terminal_call_id=terminal if reason is None else None,
            terminal_selection=selection if reason is None else None,
            terminal_cumulative_hash=(
                self.committed[terminal].cumulative_hash if reason is None and terminal else None
            ),
            capture_poisoned=reason is not None,
            failure_reason=reason,
            sealed_at=seal.sealed_at,
            sample_policy=seal.sample_policy,
            all_or_nothing=seal.all_or_nothing,
            chains=chains,
        )

    def _tree_parents(self) -> dict[str, str | None]:
        """Parents of the calls that are not committed: failed ones, and parents nobody admitted."""
        parents: dict[str, str | None] = {c: f.parent_call_id for c, f in self.failed.items()}
        # Parents nobody admitted are nodes too, also under a failed call: else a call
        # failed for naming a missing parent stands as a second root, and the rollout
        # reads ambiguous_terminal instead of that call's own code.
        named = [r.parent_call_id for r in self.committed.values()]
        named += [f.parent_call_id for f in self.failed.values()]
        for parent in named:
            if parent is not None and parent not in self.admissions:
                parents.setdefault(parent, None)
        return parents

    def _chains(self, seal: RolloutSeal) -> list[ReceiptChain]:
        """Every chain of a multi-sample policy, in admission order of its leaf, each with
        the hash its sample must have or the code that rejects it in the ledger already."""
        order = {call_id: i for i, call_id in enumerate(self.admissions)}
        leaves = select_chains(self.committed, seal.sample_policy, self._tree_parents())
        chains: list[ReceiptChain] = []
        for leaf in sorted(leaves, key=lambda c: (order.get(c, len(order)), c)):
            failure = self._chain_failure(leaf)
            if failure is None:
                chains.append(
                    ReceiptChain(leaf_call_id=leaf, cumulative_hash=self.committed[leaf].cumulative_hash)
                )
            else:
                chains.append(ReceiptChain(leaf_call_id=leaf, failure_reason=failure))
        return chains

    def _chain_failure(self, terminal: str) -> FailureReason | None:
        """A failed or missing call on the terminal chain poisons the rollout."""
        if terminal in self.failed:
            return self.failed[terminal].reason
        if terminal not in self.committed:
            return LedgerFailure.UNKNOWN_ADMISSION
        failure: FailureReason | None = None  # the failed ancestor nearest the root wins
        seen: set[str] = set()
        current = self.committed[terminal].parent_call_id
        while current is not None and current not in seen:
            seen.add(current)
            if current in self.failed:
                failure = self.failed[current].reason
                current = self.failed[current].parent_call_id
            elif current in self.committed:
                current = self.committed[current].parent_call_id
            else:
                break  # an ancestor nobody admitted: terminal_chain names it
        if failure is not None:
            return failure
        try:
            terminal_chain(self.committed, terminal)
        except NoTerminal as exc:
            return exc.code
        return None


def _starts_segment(rollout_id: str, admission: Admitted, staged: StagedEvent) -> bool:
    """A child admitted under the ``render`` policy that the worker staged as a root of
    this rollout: its prompt (the template's render) did not extend the parent's tokens."""
    coords = staged.coords
    return (
        admission.history == "render"
        and coords.rollout_id == rollout_id
        and admission.parent_call_id is not None
        and coords.parent_call_id is None
        and coords.mode == "text"
        and coords.prev_len == 0
    )


def _coords_mismatch(rollout_id: str, admission: Admitted, staged: StagedEvent) -> str | None:
    coords = staged.coords
    if (
        coords.prev_len == admission.prev_len
        and coords.parent_call_id == admission.parent_call_id
        and coords.mode == admission.mode
        and coords.rollout_id == rollout_id
    ):
        return None  # every call that joins: no tuples built to find what differs
    checks = (
        ("rollout_id", coords.rollout_id, rollout_id),
        ("parent_call_id", coords.parent_call_id, admission.parent_call_id),
        ("mode", coords.mode, admission.mode),
        ("prev_len", coords.prev_len, admission.prev_len),
    )
    for name, got, want in checks:
        if got != want:
            return f"{name}: staged {got!r}, admitted {want!r}"
    return None
