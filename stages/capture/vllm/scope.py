"""One HTTP request's capture, from its admissions to each choice's commit coords.

The HTTP route opens a scope (admissions validated, prefix resolved) before vLLM's
serving layer sees the request. vLLM's renderer then asks the scope for the prompt to
send (the exact prefix spliced over its render, DESIGN §5), and the capturing engine
client reports each finished choice to it. Whatever route the request came by, this is
the one place a call becomes a row or a failure with a code.

Every admitted choice ends exactly once: captured, or failed (``abandon``) when the
engine never finished it, so the ledger never waits out a grace period for a call
the worker knows is lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from stages.capture.chat import ChatRenderer
from stages.capture.core import CaptureCore, Completion, PreparedCall
from stages.capture.splice import SpliceError
from stages.capture.vllm.harmony import harmony_spliced
from topics.failures import WorkerFailure
from topics.records import CaptureAdmission, CommitCoords, HistoryPolicy

log = logging.getLogger(__name__)

CURRENT_SCOPE: ContextVar[CaptureScope | None] = ContextVar("tokentrail_capture_scope", default=None)
"""The scope of the request being rendered; set by the route around vLLM's handler."""


@dataclass(slots=True)
class CaptureCounters:
    """What the worker's metrics report about capture."""

    captured_requests: int = 0
    splice_failures: int = 0
    refit_straddles: int = 0
    abandoned_calls: int = 0
    segments_started: int = 0
    """Continuations under the ``render`` history policy whose render did not extend
    their parent's tokens, staged as new roots."""


class CaptureScope:
    """The admitted calls of one request: choice ``i`` is ``prepared[i]``."""

    def __init__(
        self,
        core: CaptureCore,
        prepared: Sequence[PreparedCall],
        *,
        renderer: ChatRenderer,
        response_id: str,
        counters: CaptureCounters,
    ) -> None:
        if not prepared:
            raise ValueError("prepared: a scope needs at least one admitted call")
        self.core = core
        self.prepared = list(prepared)
        self.renderer = renderer
        self.response_id = response_id
        self.counters = counters
        self.failure: WorkerFailure | None = next(
            (p.failure.code for p in prepared if p.failure is not None), None
        )
        self._completions: list[asyncio.Future[Completion]] = [
            asyncio.get_running_loop().create_future() for _ in prepared
        ]
        self.engine_calls = 0

    @classmethod
    async def open(
        cls,
        core: CaptureCore,
        admissions: Sequence[CaptureAdmission],
        *,
        renderer: ChatRenderer,
        response_id: str,
        counters: CaptureCounters,
    ) -> CaptureScope:
        """Resolve the shared prefix once; a failure is recorded on the scope, not raised."""
        first = await core.prepare(admissions[0])
        prepared = [first] + [
            PreparedCall(a, first.prefix_ids, first.parent_chain_hash, first.failure) for a in admissions[1:]
        ]
        return cls(core, prepared, renderer=renderer, response_id=response_id, counters=counters)

    @property
    def n(self) -> int:
        return len(self.prepared)

    @property
    def prefix_ids(self) -> list[int]:
        return self.prepared[0].prefix_ids.tolist()  # type: ignore[no-any-return]

    def _log_failure(self, reason: object) -> None:
        log.warning("capture of %s fails: %s", self.prepared[0].admission.staging_key, reason)

    # ------------------------------------------------------------------ the prompt

    def splice_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        full: list[int],
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The prompt for a chat render: the exact prefix over the history re-rendered with
        the template variables ``full`` was rendered with."""
        return self._spliced(
            full, lambda prefix: self.renderer.spliced(prefix, messages, tools, full, template_kwargs)
        )

    def splice_harmony(self, messages: Sequence[Any], full: list[int]) -> list[int]:
        """The prompt for vLLM's harmony render (gpt-oss) of ``messages``: the exact prefix
        over the history's render, which is a literal prefix of ``full``."""
        stops = self.renderer.eos_token_ids
        return self._spliced(full, lambda prefix: harmony_spliced(prefix, messages, full, stops))

    def _spliced(self, full: list[int], splice: Callable[[list[int]], list[int]]) -> list[int]:
        """``splice(exact prefix)`` for a continuation under ``exact`` history, else ``full``."""
        if self.failure is not None:
            self._log_failure(self.failure)
            return full
        if self.history == "render":  # the engine sees the render; capture decides the segment
            return full
        prefix = self.prefix_ids
        if not prefix:
            return full
        try:
            return splice(prefix)
        except SpliceError as exc:
            return self._splice_failed(exc, full)

    def splice_tokens(
        self, prompt: list[int], decode: Callable[[list[int]], str], text: str | None
    ) -> list[int]:
        """The prompt for a completion: it must start with the exact prefix, in ids or in text.

        A token-id prompt is sent as given (capture fails if it does not start with the
        prefix); a text prompt that starts with the prefix's text gets the exact ids for
        that part and the tokenizer's ids for the rest.
        """
        prefix = self.prefix_ids
        if self.failure is not None or not prefix or prompt[: len(prefix)] == prefix:
            return prompt
        if self.history == "render":
            return prompt
        head = decode(prefix)
        if text is not None and text.startswith(head):
            return prefix + self.renderer.encode(text[len(head) :])
        return self._splice_failed(SpliceError("the prompt does not start with the exact prefix"), prompt)

    @property
    def history(self) -> HistoryPolicy:
        return self.prepared[0].admission.history

    def _splice_failed(self, exc: SpliceError, prompt: list[int]) -> list[int]:
        self.counters.splice_failures += 1
        self._log_failure(f"{exc} (template family {self.renderer.family})")
        self.failure = exc.code
        return prompt

    # ------------------------------------------------------------------ the outcome

    def capture(
        self,
        index: int,
        prompt_ids: Sequence[int],
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        *,
        weight_version: int,
        extras: dict[str, Any] | None = None,
        failure: WorkerFailure | None = None,
    ) -> None:
        """Choice ``index`` finished: capture it (synchronous, no I/O) unless it already failed."""
        if not 0 <= index < self.n or self._completions[index].done():
            return
        self.counters.captured_requests += 1
        prepared = self.prepared[index]
        code = failure if failure is not None else self.failure
        if code is not None:
            completion = self.core.fail(prepared, code, weight_version, self.response_id)
        else:
            completion = self.core.complete(
                prepared,
                prompt_ids,
                token_ids,
                logprobs,
                weight_version=weight_version,
                extras=extras,
                response_id=self.response_id,
            )
            if completion.coords.parent_call_id is None and prepared.admission.parent_call_id is not None:
                self.counters.segments_started += 1
        self._completions[index].set_result(completion)

    def abandon(self, code: WorkerFailure, weight_version: int, index: int | None = None) -> int:
        """Fail every choice not captured yet (or only ``index``): the engine never finished it.

        Returns how many were failed.
        """
        abandoned = 0
        for i in range(self.n) if index is None else [index]:
            future = self._completions[i]
            if future.done():
                continue
            try:
                completion = self.core.fail(self.prepared[i], code, weight_version, self.response_id)
            except RuntimeError:  # no running loop (shutdown): the ledger's grace period covers it
                log.warning("could not report call %s", self.prepared[i].admission.staging_key)
                continue
            future.set_result(completion)
            abandoned += 1
        self.counters.abandoned_calls += abandoned
        return abandoned

    def captured(self, index: int) -> bool:
        return self._completions[index].done()

    async def coords(self, index: int) -> CommitCoords:
        """Choice ``index``'s coords: once its row is staged under ack ``staged``."""
        completion = await self._completions[index]
        return await completion.final_coords()


__all__ = ["CURRENT_SCOPE", "CaptureCounters", "CaptureScope"]
