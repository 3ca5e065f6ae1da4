"""The engine's ``payload_stager`` hook: coords in the reply now, the row through the writer.

``MegatronPayloadStager.stage`` (inside the step) validates the finished payload,
builds the row and its coordinates with ``capture_row`` (pure array work: delta,
hashes, digest; no I/O, no shared state), hands the row to a task on the capture loop
and returns the coordinates at once. That task only caches and queues the row
(``CaptureCore.submit``); nothing is computed twice.

The row is built inside the step because the reply needs its hashes: a child's
admission needs its parent's chain hash, so provisional coords without hashes were not
an option. Its cost is in bench/RESULTS.md (``python -m bench.megatron_hooks``). If the
writer later fails the call (queue full, data plane down), its staged event says so
and supersedes the reply, exactly as with ``AckPolicy.ENQUEUED``.

Weight versions: a call's ``weight_version`` is its admission epoch, ``policy_epoch[0]``;
a refit that lands mid-call is kept as ``[[generated_offset, version], ...]`` under
``topics.records.EXTRAS_WEIGHT_SPANS`` (policy ``allow``) or fails the capture with
``epoch_span_rejected`` (policy ``reject``). A missing or malformed ``policy_epoch``
fails the capture (``invalid_delta``); it is never taken as version 0.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from stages.capture.core import CaptureCore, CapturedRow, PreparedCall, capture_row, failed_coords
from stages.capture.errors import CaptureFailure
from stages.capture.megatron.admission import CAPTURE_KEY_FIELD, NO_PREFIX_IDS, parse_admission
from stages.capture.megatron.handoff import Handoff, HandoffClosed
from stages.capture.megatron.payload import (
    InvalidPayload,
    generation_versions,
    read_finished_call,
    sampling_extras,
)
from stages.capture.megatron.registry import PreparedCalls
from topics.failures import WorkerFailure
from topics.records import EXTRAS_WEIGHT_SPANS, CaptureAdmission, CommitCoords
from topics.sampling import EXTRAS_SAMPLING
from topics.wire import CAPTURE_FIELD, COORDS_FIELD

log = logging.getLogger(__name__)

FAILURE_FIELD = "ng_capture_failure"
"""Response metadata of a failed capture: ``{"code": <§6 code>, "detail": ...}``."""


class EpochSpanPolicy(StrEnum):
    """A call that straddles a refit: keep its per-token epochs, or fail its capture."""

    ALLOW = "allow"
    REJECT = "reject"


@dataclass(frozen=True, slots=True)
class StageResult:
    """What ``stage`` returns for a captured call; the engine merges it into the reply."""

    response_metadata: dict[str, Any]

    @property
    def coords(self) -> CommitCoords:
        return CommitCoords.model_validate(self.response_metadata[COORDS_FIELD], strict=False)


@dataclass(slots=True)
class StagerStats:
    """Counters; ``stage`` writes the first group (engine thread), the capture task the rest."""

    calls: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    defects: Counter[str] = field(default_factory=Counter)
    refused: int = 0
    processed: int = 0
    superseded: int = 0
    errors: int = 0


@dataclass(frozen=True, slots=True)
class _Work:
    """One finished call on its way to ``CaptureCore`` on the capture loop."""

    prepared: PreparedCall
    captured: CapturedRow | None
    weight_version: int
    extras: dict[str, Any] | None
    code: WorkerFailure | None
    failed: CommitCoords | None
    """The coords of a call whose capture failed (None when ``captured``)."""
    response_id: str | None
    detail: str | None = None

    @property
    def staging_key(self) -> str:
        return self.prepared.admission.staging_key

    def reply(self) -> dict[str, Any]:
        """The coords as the reply carries them; a captured call's without pydantic."""
        if self.captured is not None:
            return self.captured.coords_document()
        assert self.failed is not None, "a work item is captured or failed"
        return self.failed.model_dump(mode="json")


class MegatronPayloadStager:
    """The engine's ``payload_stager``: coords now, the row through the background writer.

    ``start`` binds it to the capture loop (the loop of ``core``'s writer); ``stage`` may
    then be called from any thread.
    """

    def __init__(
        self,
        core: CaptureCore,
        registry: PreparedCalls,
        *,
        span_policy: EpochSpanPolicy = EpochSpanPolicy.ALLOW,
        max_pending: int = 4096,
    ) -> None:
        self.core = core
        self.registry = registry
        self.span_policy = EpochSpanPolicy(span_policy)
        self.stats = StagerStats()
        self._handoff: Handoff[_Work] = Handoff(max_pending)
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._handed = 0
        self._progress = asyncio.Event()

    def start(self) -> None:
        """Start the capture task; call on the capture loop."""
        if self._task is None:
            self._handoff.bind()
            self._progress = asyncio.Event()
            self._closing = False
            self._task = asyncio.get_running_loop().create_task(self._run(), name="megatron-capture")

    async def stop(self) -> None:
        """Process everything handed off, then stop (the writer is stopped by its owner)."""
        self._closing = True
        self._handoff.wake()
        if self._task is not None:
            await self._task
            self._task = None

    async def drain(self) -> None:
        """Wait until every call handed off so far has reached ``CaptureCore``."""
        while self._handoff.pending or self.stats.processed < self._handed:
            self._progress.clear()
            await self._progress.wait()

    def stage(
        self,
        uid: Any,
        payload: Any,
        *,
        finished_metadata: Any = None,
        offload_params: Mapping[str, Any] | None = None,
    ) -> StageResult | None:
        """Capture a finished request; None for ordinary traffic. Never waits, never raises."""
        raw = offload_params.get(CAPTURE_FIELD) if isinstance(offload_params, Mapping) else None
        if raw is None or offload_params is None:
            return None
        self.stats.calls += 1
        try:
            prepared = self._served(raw, offload_params)
            if prepared is None:
                return None
            response_id = _response_id(uid)
            try:
                work = self._capture(response_id, prepared, payload, finished_metadata)
            except Exception as exc:  # a bug here must not take the engine down
                log.exception("capturing %s failed", prepared.admission.staging_key)
                work = _failed_work(prepared, WorkerFailure.INVALID_DELTA, None, response_id, repr(exc))
            return StageResult(self._hand_off(work))
        except Exception:  # the reply then goes out as ordinary traffic, tokens included
            log.exception("staging a captured request failed; it is served uncaptured")
            return None

    def _served(self, raw: Any, offload_params: Mapping[str, Any]) -> PreparedCall | None:
        key = offload_params.get(CAPTURE_KEY_FIELD)
        prepared = self.registry.release(key) if isinstance(key, str) else None
        if prepared is not None:
            return prepared
        try:
            admission = raw if isinstance(raw, CaptureAdmission) else parse_admission(raw)
        except (ValueError, TypeError, KeyError) as exc:
            log.error("ng_capture is not a valid admission; the call is not captured: %s", exc)
            return None
        if admission.mode == "text":
            return PreparedCall(admission, NO_PREFIX_IDS, None)
        failure = CaptureFailure(
            WorkerFailure.PREFIX_UNAVAILABLE, "the prompt was not prepared (is prompt_preparer installed?)"
        )
        return PreparedCall(admission, NO_PREFIX_IDS, None, failure)

    def _capture(
        self, response_id: str | None, prepared: PreparedCall, payload: Any, finished_metadata: Any
    ) -> _Work:
        try:
            call = read_finished_call(payload, finished_metadata)
            versions = generation_versions(call.policy_epoch, call.prompt_ids.size, call.generated_ids.size)
        except InvalidPayload as exc:
            self.stats.defects[exc.defect.value] += 1
            if prepared.failure is not None:  # the earlier failure is the cause
                return _failed_work(
                    prepared, prepared.failure.code, None, response_id, prepared.failure.detail
                )
            return _failed_work(prepared, exc.code, None, response_id, exc.defect.value)
        version = versions.weight_version
        if prepared.failure is not None:
            return _failed_work(
                prepared, prepared.failure.code, version, response_id, prepared.failure.detail
            )
        extras: dict[str, Any] = {}
        if versions.spans is not None:
            extras[EXTRAS_WEIGHT_SPANS] = versions.spans
        try:
            sampling = sampling_extras(payload, finished_metadata)
        except InvalidPayload as exc:
            self.stats.defects[exc.defect.value] += 1
            return _failed_work(prepared, exc.code, version, response_id, str(exc))
        if sampling is not None:
            extras[EXTRAS_SAMPLING] = sampling
        if versions.straddles_refit and self.span_policy is EpochSpanPolicy.REJECT:
            detail = f"epochs {versions.spans} under policy reject"
            return _failed_work(prepared, WorkerFailure.EPOCH_SPAN_REJECTED, version, response_id, detail)
        try:
            captured = capture_row(
                prepared,
                call.prompt_ids,
                call.generated_ids,
                call.generated_logprobs,
                weight_version=version,
                extras=extras or None,
            )
        except CaptureFailure as exc:
            return _failed_work(prepared, exc.code, version, response_id, exc.detail)
        return _Work(prepared, captured, version, extras or None, None, None, response_id)

    def _hand_off(self, work: _Work) -> dict[str, Any]:
        try:
            accepted = self._handoff.put(work, force=work.code is not None)
            if not accepted:
                self.stats.refused += 1
                detail = "capture hand-off queue full"
                work = _failed_work(
                    work.prepared,
                    WorkerFailure.STAGING_WRITE_FAILED,
                    work.weight_version,
                    work.response_id,
                    detail,
                )
                self._handoff.put(work, force=True)
            self._handed += 1
        except HandoffClosed as exc:
            self.stats.refused += 1
            log.error("capture loop is not running; %s is not staged: %s", work.staging_key, exc)
            work = _failed_work(
                work.prepared,
                WorkerFailure.STAGING_WRITE_FAILED,
                work.weight_version,
                work.response_id,
                str(exc),
            )
        if work.code is not None:
            self.stats.failed[work.code.value] += 1
        metadata: dict[str, Any] = {COORDS_FIELD: work.reply()}
        if work.code is not None:
            metadata[FAILURE_FIELD] = {"code": work.code.value, "detail": work.detail}
        return metadata

    async def _run(self) -> None:
        while True:
            batch = self._handoff.take()
            if not batch:
                if self._closing:
                    return
                await self._handoff.wait()
                continue
            for work in batch:
                self._process(work)
                self.stats.processed += 1
            self._progress.set()
            await asyncio.sleep(0)  # let the writer and prefetches run between batches

    def _process(self, work: _Work) -> None:
        try:
            if work.code is not None or work.captured is None:
                code = work.code or WorkerFailure.INVALID_DELTA
                completion = self.core.fail(work.prepared, code, work.weight_version, work.response_id)
            else:  # built in the engine's hook: only cached and queued here, never recomputed
                completion = self.core.submit(work.prepared, work.captured, work.response_id)
        except Exception:
            self.stats.errors += 1
            log.exception("capture core failed on %s", work.staging_key)
            return
        # The reply said staged (no code) or failed with ``work.code``; only the writer
        # refusing the row changes that, so the codes tell it without a second record.
        if completion.coords.failure_reason != work.code:
            self.stats.superseded += 1
            log.warning(
                "%s: reply coords superseded (%s -> %s)",
                work.staging_key,
                work.code or "staged",
                completion.coords.failure_reason or completion.coords.disposition,
            )


def _failed_work(
    prepared: PreparedCall,
    code: WorkerFailure,
    weight_version: int | None,
    response_id: str | None,
    detail: str | None,
) -> _Work:
    # Without a readable policy_epoch the version is unknown; a failed call writes no row,
    # and 0 is only the placeholder the CommitCoords schema requires.
    version = 0 if weight_version is None else weight_version
    coords = failed_coords(prepared.admission, code, version)
    return _Work(prepared, None, version, None, code, coords, response_id, detail)


def _response_id(uid: Any) -> str | None:
    """Megatron's request uid (the OpenAI response id) when it fits a label."""
    if uid is None:
        return None
    text = str(uid)
    return text if 0 < len(text) <= 200 else None


__all__ = [
    "FAILURE_FIELD",
    "EpochSpanPolicy",
    "MegatronPayloadStager",
    "StageResult",
    "StagerStats",
]
