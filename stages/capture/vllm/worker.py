"""The vLLM worker's logic: one chat call from messages to captured ids and a reply.

Per call with an admission: resolve the prefix (``CaptureCore.prepare``) before the
engine sees anything, render the template and splice the exact prefix over the
re-rendered history, generate token-in, then capture synchronously
(``CaptureCore.complete``) and hand the ``Completion`` back: the HTTP layer decides,
by ack policy, whether to wait for the staged coords. A call whose prefix cannot be
trusted or spliced is still served, from the plain render, and its capture fails with
the code (DESIGN §5, §6).

Weight versions: the worker changes versions itself (``set_weight_version``), so it
knows the version in effect when a call enters the engine and stamps that on the call.
When vLLM reports that some generated tokens came from other weights (a refit landed
mid-call, or while the call waited in a paused engine), the spans go into the row's
extras under ``EXTRAS_WEIGHT_SPANS`` as ``[[generated_offset, version], ...]``.

The engine is any ``TokenEngine``; ``stages.capture.vllm.engine.VllmEngine`` is the real
one (``processed_logprobs``: recorded logprobs are those of the sampling distribution).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from stages.capture.chat import AssistantReply, ChatRenderer, parse_reply
from stages.capture.core import CaptureCore, Completion, PreparedCall
from stages.capture.engine import EngineRequestError, Generation, Sampling, TokenEngine, VersionSpan
from stages.capture.splice import SpliceError
from topics.failures import WorkerFailure
from topics.records import EXTRAS_WEIGHT_SPANS, CaptureAdmission

log = logging.getLogger(__name__)


class SpanPolicy(StrEnum):
    """What a call that straddles a refit gets: its spans recorded, or its capture failed."""

    RECORD = "record"
    REJECT = "reject"


class RequestRejected(ValueError):
    """The request cannot be served as asked; ``param`` names the offending field."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


class WorkerStateError(RuntimeError):
    """An admin operation out of order (e.g. reloading weights while serving)."""


@dataclass(frozen=True, slots=True)
class ChatCall:
    """A chat request as the worker needs it; ``max_tokens=None`` means the rest of the context."""

    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class ServedChat:
    """A served call: the reply, usage, and its capture (None without an admission)."""

    response_id: str
    reply: AssistantReply
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    weight_version: int
    completion: Completion | None


@dataclass(slots=True)
class WorkerCounters:
    requests: int = 0
    captured_requests: int = 0
    rejected_requests: int = 0
    engine_errors: int = 0
    splice_failures: int = 0
    refit_straddles: int = 0


class VllmWorker:
    """Serves chat calls on a token-in engine and captures those that carry an admission."""

    def __init__(
        self,
        engine: TokenEngine,
        renderer: ChatRenderer,
        core: CaptureCore,
        *,
        weight_version: int = 0,
        span_policy: SpanPolicy = SpanPolicy.RECORD,
    ) -> None:
        if weight_version < 0:
            raise ValueError(f"weight_version: must be >= 0, got {weight_version}")
        self.engine = engine
        self.renderer = renderer
        self.core = core
        self.span_policy = span_policy
        self.counters = WorkerCounters()
        self._version = weight_version
        self._paused = False
        self._admin = asyncio.Lock()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Label the engine's weights with our version and start the staging writer."""
        await self.engine.set_weight_version(str(self._version))
        self.core.writer.start()

    async def stop(self) -> None:
        """Drain the staging writer: every captured call gets its staged event."""
        await self.core.writer.stop()

    # ---------------------------------------------------------------------- serving

    async def chat(
        self, call: ChatCall, admission: CaptureAdmission | None, *, response_id: str
    ) -> ServedChat:
        """Serve one call; raises ``RequestRejected`` (client) or ``EngineUnavailable`` (server)."""
        self.counters.requests += 1
        prepared = await self.core.prepare(admission) if admission is not None else None
        version = self._version
        try:
            prompt, failure = self._prompt(call, prepared)
            sampling = self._sampling(call, len(prompt))
            version = self._version  # the version in effect when the call enters the engine
            generation = await self.engine.generate(prompt, sampling, response_id)
        except RequestRejected:
            self.counters.rejected_requests += 1
            self._unserved(prepared, version, response_id)
            raise
        except EngineRequestError as exc:
            self.counters.rejected_requests += 1
            self._unserved(prepared, version, response_id)
            raise RequestRejected(None, str(exc)) from None
        except BaseException:  # engine failure or the client went away: report, then propagate
            self.counters.engine_errors += 1
            self._unserved(prepared, version, response_id)
            raise
        completion = None
        if prepared is not None:
            completion = self._capture(prepared, prompt, generation, version, failure, response_id)
        reply = parse_reply(generation.text)
        finish = "tool_calls" if reply.tool_calls else (generation.finish_reason or "stop")
        return ServedChat(
            response_id=response_id,
            reply=reply,
            finish_reason=finish,
            prompt_tokens=len(prompt),
            completion_tokens=len(generation.token_ids),
            weight_version=version,
            completion=completion,
        )

    def _prompt(
        self, call: ChatCall, prepared: PreparedCall | None
    ) -> tuple[list[int], WorkerFailure | None]:
        """The ids to send, and the capture failure already known (the call is served anyway)."""
        try:
            full = self.renderer.render(call.messages, call.tools)
        except Exception as exc:  # template errors are the request's fault (bad roles, shapes)
            raise RequestRejected("messages", f"the chat template cannot render them: {exc}") from None
        if prepared is None:
            return full, None
        if prepared.failure is not None:
            log.warning("capture of %s fails: %s", prepared.admission.staging_key, prepared.failure)
            return full, prepared.failure.code
        if prepared.prefix_ids.size == 0:
            return full, None
        try:
            return self.renderer.spliced(prepared.prefix_ids.tolist(), call.messages, call.tools, full), None
        except SpliceError as exc:
            self.counters.splice_failures += 1
            log.warning("capture of %s fails: %s", prepared.admission.staging_key, exc)
            return full, exc.code

    def _sampling(self, call: ChatCall, prompt_len: int) -> Sampling:
        room = self.engine.max_model_len - prompt_len
        if room < 1:
            raise RequestRejected(
                "messages",
                f"the prompt has {prompt_len} tokens; the context holds {self.engine.max_model_len}",
            )
        max_tokens = room if call.max_tokens is None else call.max_tokens
        if max_tokens < 1:
            raise RequestRejected("max_tokens", f"must be >= 1, got {max_tokens}")
        if max_tokens > room:
            raise RequestRejected(
                "max_tokens",
                f"{max_tokens} new tokens after a {prompt_len}-token prompt exceed the "
                f"context of {self.engine.max_model_len}",
            )
        return Sampling(
            max_tokens=max_tokens,
            temperature=call.temperature,
            top_p=call.top_p,
            seed=call.seed,
            stop=call.stop,
            ignore_eos=call.ignore_eos,
        )

    def _capture(
        self,
        prepared: PreparedCall,
        prompt: list[int],
        generation: Generation,
        version: int,
        failure: WorkerFailure | None,
        response_id: str,
    ) -> Completion:
        """Synchronous and I/O-free, like an engine completion hook."""
        self.counters.captured_requests += 1
        extras: dict[str, Any] | None = None
        if failure is None:
            try:
                spans = weight_spans(generation.version_spans, version)
            except ValueError as exc:
                log.warning("capture of %s fails: %s", prepared.admission.staging_key, exc)
                failure = WorkerFailure.EPOCH_SPAN_REJECTED
            else:
                if spans is not None:
                    self.counters.refit_straddles += 1
                    if self.span_policy is SpanPolicy.REJECT:
                        failure = WorkerFailure.EPOCH_SPAN_REJECTED
                    extras = {EXTRAS_WEIGHT_SPANS: spans}
        if failure is not None:
            return self.core.fail(prepared, failure, version, response_id)
        return self.core.complete(
            prepared,
            prompt,
            generation.token_ids,
            generation.logprobs,
            weight_version=version,
            extras=extras,
            response_id=response_id,
        )

    def _unserved(self, prepared: PreparedCall | None, version: int, response_id: str) -> None:
        """An admitted call the engine never finished: tell the ledger now, not after a grace period."""
        if prepared is None:
            return
        try:
            self.core.fail(prepared, WorkerFailure.NOT_SERVED, version, response_id)
        except RuntimeError:  # no running loop any more (shutdown): the ledger's grace period covers it
            log.warning("could not report unserved call %s", prepared.admission.staging_key)

    # ----------------------------------------------------------------------- refits

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def paused(self) -> bool:
        return self._paused

    async def pause(self) -> None:
        """Freeze generation; in-flight calls keep their place and continue after ``resume``."""
        async with self._admin:
            await self.engine.pause()
            self._paused = True

    async def reload_weights(self, path: str) -> None:
        """Load a checkpoint; only while paused, so no token is generated from half-loaded weights."""
        if not await asyncio.to_thread(os.path.isdir, path):
            raise RequestRejected("path", f"{path} is not a checkpoint directory")
        async with self._admin:
            if not self._paused:
                raise WorkerStateError("reload_weights: pause the worker first")
            await self.engine.reload_weights(path)

    async def set_weight_version(self, version: int) -> None:
        """Label the weights now loaded; calls entering from now on are stamped with it."""
        if version < 0:
            raise RequestRejected("version", f"must be >= 0, got {version}")
        async with self._admin:
            await self.engine.set_weight_version(str(version))
            self._version = version

    async def resume(self) -> None:
        async with self._admin:
            await self.engine.resume()
            self._paused = False


def weight_spans(spans: Sequence[VersionSpan], admission_version: int) -> list[list[int]] | None:
    """``[[generated_offset, version], ...]`` when any token came from other weights, else None.

    Empty spans are dropped and neighbours with one version merged; tokens before the
    first labelled span belong to the admission version. Raises ``ValueError`` for a
    version label that is not a non-negative integer.
    """
    pairs: list[list[int]] = []
    for span in spans:
        if span.end <= span.start:
            continue
        try:
            version = int(span.version)
        except ValueError:
            raise ValueError(f"weight version label {span.version!r} is not an integer") from None
        if version < 0:
            raise ValueError(f"weight version label {span.version!r} is negative")
        if pairs and pairs[-1][1] == version:
            continue
        pairs.append([span.start, version])
    if not pairs:
        return None
    if pairs[0][0] != 0:
        if pairs[0][1] == admission_version:
            pairs[0][0] = 0
        else:
            pairs.insert(0, [0, admission_version])
    if pairs == [[0, admission_version]]:
        return None
    return pairs


__all__ = [
    "ChatCall",
    "RequestRejected",
    "ServedChat",
    "SpanPolicy",
    "VllmWorker",
    "WorkerCounters",
    "WorkerStateError",
    "weight_spans",
]
