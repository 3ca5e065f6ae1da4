"""The vLLM worker's own state: capture around vLLM's serving layers, and refits.

vLLM serves every protocol; the worker adds what capture needs around it: a scope per
captured request (``open_scope``: admissions validated, prefix resolved before the
engine sees anything), the capturing engine client the serving layers call, and the
refit sequence (DESIGN §8) with the weight version every call is stamped with. A call
whose prefix cannot be trusted or spliced is still served, from vLLM's plain render,
and its capture fails with the code (DESIGN §5, §6).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from stages.capture.chat import ChatRenderer
from stages.capture.core import CaptureCore
from stages.capture.vllm.client import CapturingEngineClient, parse_weight_version
from stages.capture.vllm.scope import CaptureCounters, CaptureScope
from topics.records import CaptureAdmission


class RequestRejected(ValueError):
    """The request cannot be served as asked; ``param`` names the offending field."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


class WorkerStateError(RuntimeError):
    """An admin operation out of order (e.g. reloading weights while serving)."""


class WeightLoader(Protocol):
    async def reload_weights(self, path: str) -> None:
        """Load a checkpoint directory into the running model (call while paused)."""


@dataclass(slots=True)
class RequestCounters:
    """Requests the HTTP layer saw, by outcome."""

    requests: int = 0
    rejected_requests: int = 0


class VllmWorker:
    """Capture state and refit controls of one worker; vLLM's serving layers do the serving."""

    def __init__(
        self,
        client: CapturingEngineClient,
        weights: WeightLoader,
        renderer: ChatRenderer,
        core: CaptureCore,
    ) -> None:
        self.client = client
        self.weights = weights
        self.renderer = renderer
        self.core = core
        self.requests = RequestCounters()
        self._admin = asyncio.Lock()

    @property
    def capture_counters(self) -> CaptureCounters:
        return self.client.counters

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Label the engine's weights with our version and start the staging writer."""
        await self.client.update_weight_version(str(self.client.weight_version))
        self.core.writer.start()

    async def stop(self) -> None:
        """Drain the staging writer: every captured call gets its staged event."""
        await self.core.writer.stop()

    # -------------------------------------------------------------------- capture

    async def open_scope(self, admissions: Sequence[CaptureAdmission], response_id: str) -> CaptureScope:
        return await CaptureScope.open(
            self.core,
            admissions,
            renderer=self.renderer,
            response_id=response_id,
            counters=self.capture_counters,
        )

    # ----------------------------------------------------------------------- refits

    @property
    def weight_version(self) -> int:
        return self.client.weight_version

    @property
    def paused(self) -> bool:
        return self.client.paused

    async def pause(self) -> None:
        """Freeze generation; in-flight calls keep their place and continue after ``resume``.

        Clearing the cache makes them recompute their KV with the new weights, so tokens
        after a refit really come from those weights.
        """
        async with self._admin:
            await self.client.pause_generation(mode="keep", clear_cache=True)

    async def reload_weights(self, path: str) -> None:
        """Load a checkpoint; only while paused, so no token is generated from half-loaded weights."""
        if not await asyncio.to_thread(os.path.isdir, path):
            raise RequestRejected("path", f"{path} is not a checkpoint directory")
        async with self._admin:
            if not self.paused:
                raise WorkerStateError("reload_weights: pause the worker first")
            await self.weights.reload_weights(path)

    async def set_weight_version(self, version: int) -> None:
        """Label the weights now loaded; calls entering from now on are stamped with it."""
        parse_weight_version(version)
        async with self._admin:
            await self.client.update_weight_version(str(version))

    async def resume(self) -> None:
        async with self._admin:
            await self.client.resume_generation()


__all__ = ["RequestCounters", "RequestRejected", "VllmWorker", "WeightLoader", "WorkerStateError"]
