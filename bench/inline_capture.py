"""The inline baseline: capture the way upstream Megatron does it, inside the engine step.

Both hook shapes, but every data-plane call is awaited by the step itself:
``prepare_prompt`` reads the admission's ancestor rows from the data plane (one batched
read, verified by the same ``PrefixResolver`` tokentrail uses, with no chain cache) and
``stage`` builds the full row and writes it with ``put_calls`` before the request may
finish. The step thread blocks on each call while the capture loop runs it, so the
whole batch waits for the data plane once per admitted and once per finished request.

It exists only to be measured against ``MegatronPromptPreparer`` /
``MegatronPayloadStager``, which do the same reads before admission and the same
writes in a background writer.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from stages.capture.cache import ChainCache, ChainLink
from stages.capture.core import CaptureCore, PreparedCall, capture_row, failed_coords
from stages.capture.errors import CaptureFailure
from stages.capture.megatron.admission import parse_admission
from stages.capture.megatron.payload import generation_versions, read_finished_call
from stages.capture.resolve import PrefixResolver
from stages.capture.writer import StagingWriter
from stages.memory import RecordingSink
from stages.ports import DataPlane, DataPlaneError
from topics.failures import WorkerFailure
from topics.records import CommitCoords
from topics.wire import CAPTURE_FIELD, COORDS_FIELD

T = TypeVar("T")
PREPARED_FIELD = "bench_inline_prepared"
"""Where ``prepare_prompt`` leaves the resolved call for ``stage`` in ``offload_params``."""


class NoCache(ChainCache):
    """A chain cache that keeps nothing: every prefix is read from the data plane."""

    def put(self, link: ChainLink) -> None:
        del link


@dataclass(frozen=True, slots=True)
class InlineResult:
    """The reply fields of a captured call (the payload stager's result shape)."""

    response_metadata: dict[str, Any]


@dataclass(slots=True)
class InlineStats:
    reads: int = 0
    writes: int = 0
    failed: Counter[str] = field(default_factory=Counter)


class InlineCapture:
    """Both engine hooks, blocking the step on every data-plane call (the upstream style).

    Build it on the capture loop (the loop the data plane's client lives on); the hooks
    must then be called from another thread (the engine's), which they block.
    """

    def __init__(self, data_plane: DataPlane, *, timeout_s: float = 60.0) -> None:
        self.data_plane = data_plane
        self.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self.timeout_s = timeout_s
        self.stats = InlineStats()
        cache = NoCache()
        resolver = PrefixResolver(data_plane, cache, wait_s=timeout_s)
        # Only ``prepare`` is used: the writer is never started.
        self.core = CaptureCore(
            resolver, StagingWriter(data_plane, RecordingSink(), worker_id="inline"), cache
        )

    def prepare_prompt(
        self, prompt: Any, *, offload_params: Mapping[str, Any] | None
    ) -> tuple[Any, Mapping[str, Any] | None]:
        """Resolve the prefix from the data plane now, while the step waits."""
        raw = offload_params.get(CAPTURE_FIELD) if isinstance(offload_params, Mapping) else None
        if raw is None or offload_params is None:
            return prompt, offload_params
        admission = parse_admission(raw)
        if admission.mode == "token_in":
            self.stats.reads += 1
        prepared = self._wait(self.core.prepare(admission))
        return prompt, {**offload_params, PREPARED_FIELD: prepared}

    def stage(
        self,
        uid: Any,
        payload: Any,
        *,
        finished_metadata: Any = None,
        offload_params: Mapping[str, Any] | None = None,
    ) -> InlineResult | None:
        """Build the row and write it now, while the step waits; then reply with coords."""
        del uid
        prepared = offload_params.get(PREPARED_FIELD) if isinstance(offload_params, Mapping) else None
        if not isinstance(prepared, PreparedCall):
            return None
        coords = self._capture(prepared, payload, finished_metadata)
        if coords.disposition != "staged":
            self.stats.failed[str(coords.failure_reason)] += 1
        return InlineResult({COORDS_FIELD: coords.model_dump(mode="json")})

    def _capture(self, prepared: PreparedCall, payload: Any, finished_metadata: Any) -> CommitCoords:
        admission = prepared.admission
        try:
            call = read_finished_call(payload, finished_metadata)
        except CaptureFailure as exc:
            return failed_coords(admission, exc.code, 0)
        version = generation_versions(
            call.policy_epoch, call.prompt_ids.size, call.generated_ids.size
        ).weight_version
        if prepared.failure is not None:
            return failed_coords(admission, prepared.failure.code, version)
        try:
            captured = capture_row(
                prepared, call.prompt_ids, call.generated_ids, call.generated_logprobs, weight_version=version
            )
        except CaptureFailure as exc:
            return failed_coords(admission, exc.code, version)
        try:
            self._wait(self.data_plane.put_calls([captured.row]))
        except (DataPlaneError, TimeoutError):
            return failed_coords(admission, WorkerFailure.STAGING_WRITE_FAILED, version)
        self.stats.writes += 1
        return captured.coords()

    def _wait(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the capture loop and block this (engine) thread until it is done."""
        if threading.get_ident() == self._loop_thread:
            coro.close()
            raise RuntimeError("inline capture blocks its caller: call it from the engine thread")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout_s)


__all__ = ["PREPARED_FIELD", "InlineCapture", "InlineResult", "InlineStats", "NoCache"]
