"""The engine-agnostic capture core used by the vLLM and Megatron adapters.

``prepare`` runs before the engine admits a request (async: it may read the data
plane). ``complete`` runs when the engine finishes one: synchronous, no I/O, no
waiting. It builds the delta, every hash and the digest, caches the row for children
on this worker, hands it to the background writer and returns ``CommitCoords``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import numpy.typing as npt

from stages.capture.cache import ChainCache, ChainLink
from stages.capture.errors import CaptureFailure
from stages.capture.resolve import PrefixResolver
from stages.capture.writer import PendingCall, StagingWriter
from topics.canonical import EncodingError, FloatsLike, IdsLike
from topics.digest import InvalidDelta, build_delta
from topics.failures import WorkerFailure
from topics.records import EVENT_SCHEMA_VERSION, CaptureAdmission, CommitCoords, assemble, staging_key
from topics.staging import StagedRow, build_row


class AckPolicy(StrEnum):
    """When the worker replies: after the row is staged, or as soon as it is queued."""

    STAGED = "staged"
    ENQUEUED = "enqueued"


@dataclass(frozen=True, slots=True)
class PreparedCall:
    """An admission with its resolved prefix, or the reason capture already failed."""

    admission: CaptureAdmission
    prefix_ids: npt.NDArray[np.int64]
    parent_chain_hash: str | None
    failure: CaptureFailure | None = None

    def as_segment_root(self) -> PreparedCall:
        """The call staged as a root of its rollout: under the ``render`` history policy a
        prompt that does not extend the parent's tokens starts a new segment (DESIGN §5.1)."""
        root = self.admission.model_copy(
            update={
                "parent_call_id": None,
                "mode": "text",
                "prev_len": 0,
                "staging_chain": None,
                "parent_chain_hash": None,
            }
        )
        return PreparedCall(root, _EMPTY, None, self.failure)


@dataclass(frozen=True, slots=True)
class Completion:
    """What ``complete`` hands back: coords now, and (policy ``staged``) a future of the final coords."""

    coords: CommitCoords
    staged: asyncio.Future[CommitCoords] | None

    async def final_coords(self) -> CommitCoords:
        return self.coords if self.staged is None else await self.staged


class CaptureCore:
    """Prefix resolution before the engine, capture after it; one per worker."""

    def __init__(
        self,
        resolver: PrefixResolver,
        writer: StagingWriter,
        cache: ChainCache,
        *,
        ack_policy: AckPolicy = AckPolicy.STAGED,
    ) -> None:
        self.resolver = resolver
        self.writer = writer
        self.cache = cache
        self.ack_policy = ack_policy
        writer.on_failed = cache.discard

    async def prepare(self, admission: CaptureAdmission) -> PreparedCall:
        """Resolve the prefix; a failure is recorded, not raised: the call is still served."""
        try:
            resolved = await self.resolver.resolve(admission)
        except CaptureFailure as failure:
            return PreparedCall(admission, _EMPTY, None, failure)
        if resolved is None:
            return PreparedCall(admission, _EMPTY, None)
        return PreparedCall(admission, resolved.ids, resolved.chain_hash)

    def complete(
        self,
        prepared: PreparedCall,
        prompt_ids: IdsLike,
        generated_ids: IdsLike,
        generated_logprobs: FloatsLike,
        *,
        weight_version: int,
        extras: dict[str, Any] | None = None,
        response_id: str | None = None,
    ) -> Completion:
        """Capture a finished call. Synchronous and I/O-free: safe inside an engine step."""
        if prepared.failure is not None:
            return self.fail(prepared, prepared.failure.code, weight_version, response_id)
        try:
            captured = capture_row(
                prepared,
                prompt_ids,
                generated_ids,
                generated_logprobs,
                weight_version=weight_version,
                extras=extras,
            )
        except CaptureFailure as failure:
            return self.fail(prepared, failure.code, weight_version, response_id)
        return self.submit(prepared, captured, response_id)

    def submit(
        self, prepared: PreparedCall, captured: CapturedRow, response_id: str | None = None
    ) -> Completion:
        """Cache a built row for children on this worker and queue it for staging (event loop only)."""
        row = captured.row
        coords = captured.coords()
        self.cache.put(ChainLink(row.staging_key, row.token_ids, row.chain_hash, row.cum_len))
        done = self._future()
        if not self.writer.submit(PendingCall(coords, row, response_id, done)):
            self.cache.discard(row.staging_key)
            return self.fail(
                prepared, WorkerFailure.STAGING_WRITE_FAILED, row.weight_version, response_id, row
            )
        return Completion(coords, done)

    def fail(
        self,
        prepared: PreparedCall,
        code: WorkerFailure,
        weight_version: int,
        response_id: str | None = None,
        row: StagedRow | None = None,
    ) -> Completion:
        """Report a served call whose capture failed; the driver still gets coords."""
        coords = failed_coords(prepared.admission, code, weight_version, row)
        done = self._future()
        self.writer.submit_failure(PendingCall(coords, None, response_id, done))
        return Completion(coords, done)

    def finalized(self, rollout_id: str) -> list[str]:
        """A finalized rollout takes no more calls: let go of its cached links and its held
        rows; returns the held rows' keys, for the caller to delete."""
        self.cache.forget_rollout(rollout_id)
        return [] if self.writer.retained is None else self.writer.retained.release(rollout_id)

    def refuse(self, admission: CaptureAdmission, weight_version: int) -> Completion:
        """An admitted call whose request was refused before the engine: ``not_served`` at once."""
        return self.fail(PreparedCall(admission, _EMPTY, None), WorkerFailure.NOT_SERVED, weight_version)

    def _future(self) -> asyncio.Future[CommitCoords] | None:
        if self.ack_policy is AckPolicy.ENQUEUED:
            return None
        return asyncio.get_running_loop().create_future()


_EMPTY: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class CapturedRow:
    """A finished call's row (arrays), built but not yet staged, and its staging chain.

    Its coords exist first as a plain JSON document (what a reply carries, built without
    pydantic inside the engine step); ``coords`` makes the record on the capture loop.
    """

    row: StagedRow
    staging_chain: list[str]

    def coords_document(self) -> dict[str, Any]:
        """``coords().model_dump(mode="json")``, written out directly (tested equal)."""
        row = self.row
        return {
            "schema_version": EVENT_SCHEMA_VERSION,
            "rollout_id": row.rollout_id,
            "call_id": row.call_id,
            "parent_call_id": row.parent_call_id,
            "mode": row.mode,
            "prev_len": row.prev_len,
            "delta_len": row.delta_len,
            "cum_len": row.cum_len,
            "weight_version": row.weight_version,
            "staging_key": self.staging_chain[-1],
            "chain_hash": row.chain_hash,
            "cumulative_hash": row.cumulative_hash,
            "digest": row.digest,
            "extras_digest": row.extras_digest,
            "disposition": "staged",
            "failure_reason": None,
            "staging_chain": self.staging_chain,
        }

    def coords(self) -> CommitCoords:
        """The record, built without re-validation: every field was checked or computed here."""
        return assemble(CommitCoords, self.coords_document())


def capture_row(
    prepared: PreparedCall,
    prompt_ids: IdsLike,
    generated_ids: IdsLike,
    generated_logprobs: FloatsLike,
    *,
    weight_version: int,
    extras: dict[str, Any] | None = None,
) -> CapturedRow:
    """Delta, hashes, digest and coords of a finished call; raises ``CaptureFailure``.

    A prompt that does not start with the exact prefix fails ``prefix_splice_failed``,
    except under the ``render`` history policy, where the call is staged as the root of
    a new segment (the template rewrote an earlier turn, DESIGN §5.1).

    Pure computation on its arguments (no shared state), so an engine thread may call it
    and hand the result to ``CaptureCore.submit`` on the event loop.
    """
    if not starts_with(prompt_ids, prepared.prefix_ids):
        if prepared.admission.history != "render":
            raise CaptureFailure(
                WorkerFailure.PREFIX_SPLICE_FAILED, "prompt does not start with the exact prefix"
            )
        prepared = prepared.as_segment_root()
    admission = prepared.admission
    prefix = prepared.prefix_ids
    try:
        delta = build_delta(prompt_ids, generated_ids, generated_logprobs, admission.prev_len)
        row = build_row(
            rollout_id=admission.rollout_id,
            call_id=admission.call_id,
            parent_call_id=admission.parent_call_id,
            parent_chain_hash=prepared.parent_chain_hash,
            prefix_ids=prefix,
            delta=delta,
            weight_version=weight_version,
            extras=extras,
        )
    except (InvalidDelta, EncodingError, ValueError) as exc:
        raise CaptureFailure(WorkerFailure.INVALID_DELTA, str(exc)) from None
    return CapturedRow(row, [*(admission.staging_chain or []), row.staging_key])


def failed_coords(
    admission: CaptureAdmission, code: WorkerFailure, weight_version: int, row: StagedRow | None = None
) -> CommitCoords:
    """Coords of a served call whose capture failed (with the row's lengths when one was built)."""
    key = staging_key(admission.rollout_id, admission.call_id)
    return CommitCoords(
        rollout_id=admission.rollout_id,
        call_id=admission.call_id,
        parent_call_id=admission.parent_call_id,
        mode=admission.mode,
        prev_len=admission.prev_len,
        delta_len=0 if row is None else row.delta_len,
        cum_len=admission.prev_len if row is None else row.cum_len,
        weight_version=weight_version,
        staging_key=key,
        staging_chain=[*(admission.staging_chain or []), key],
        disposition="capture_failed",
        failure_reason=code,
    )


def starts_with(prompt_ids: IdsLike, prefix: npt.NDArray[np.int64]) -> bool:
    """Whether the prompt begins with the exact prefix; ids that are not integers never do."""
    if len(prompt_ids) < prefix.size:
        return False
    try:
        head = np.asarray(prompt_ids[: prefix.size], dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        return False
    return head.tobytes() == prefix.tobytes()  # both int64: equal bytes, equal ids


__all__ = [
    "AckPolicy",
    "CaptureCore",
    "CapturedRow",
    "Completion",
    "PreparedCall",
    "capture_row",
    "failed_coords",
]
