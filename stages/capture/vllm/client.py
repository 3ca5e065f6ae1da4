"""vLLM's engine client with capture attached where the engine's outputs are.

vLLM's serving layers (chat, completions, Responses, Messages) call ``generate`` on an
engine client; this one is that client, wrapped. A request whose engine input carries a
capture scope (tagged by the renderer, ``tag_engine_input``) gets the sampled token's
logprob added to its sampling parameters, its outputs accumulated per choice (streamed
deltas or final outputs alike), and each finished choice captured synchronously the
moment the engine reports it, before the serving layer turns it into a reply. Every
other request, and every other method, goes to vLLM untouched.

Weight versions: vLLM labels output tokens with the version last set through
``update_weight_version`` and reports the spans on a choice's final output; it stamps
nothing at admission, so this client, through which every version change goes,
remembers the version in effect when a call enters the engine and stamps that on it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from stages.capture.vllm.logprobs import SAMPLED_ONLY, SampledLogprobHook
from stages.capture.vllm.provenance import provenance_of_params
from stages.capture.vllm.scope import CaptureCounters, CaptureScope
from topics.failures import WorkerFailure
from topics.records import EXTRAS_WEIGHT_SPANS
from topics.sampling import EXTRAS_SAMPLING

log = logging.getLogger(__name__)

SCOPE_KEY = "tokentrail_capture_scope"
"""The engine-input key under which the renderer hands a request's scope to ``generate``."""


UNFINISHED = frozenset({"abort", "error"})
"""Finish reasons of a choice the engine gave up on: failed at once, never staged (and never
left for the end of the stream, which a reply waiting on the choice's coords would not reach)."""


class SpanPolicy(StrEnum):
    """What a call that straddles a refit gets: its spans recorded, or its capture failed."""

    RECORD = "record"
    REJECT = "reject"


class LogprobPath(StrEnum):
    """How captured calls get the sampled token's logprob: capture's own path (``sampled``:
    the engine's sampler computes it directly, and a request whose client asked for no
    logprobs keeps the float alone), or vLLM's whole logprob output (``vllm``)."""

    SAMPLED = "sampled"
    VLLM = "vllm"


class InvalidWeightVersion(ValueError):
    """A weight-version label that is not a non-negative integer (tokentrail stamps integers)."""


def tag_engine_input(engine_input: dict[str, Any], scope: CaptureScope) -> None:
    engine_input[SCOPE_KEY] = scope


def parse_weight_version(label: object) -> int:
    try:
        version = int(str(label))
    except ValueError:
        raise InvalidWeightVersion(f"version: {label!r} is not an integer") from None
    if version < 0:
        raise InvalidWeightVersion(f"version: must be >= 0, got {version}")
    return version


@dataclass(slots=True)
class _Choice:
    """One choice's generated ids and sampled logprobs, accumulated over streamed outputs."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def add(self, completion: Any, *, delta: bool, sampled_only: bool) -> None:
        """``sampled_only``: the output's logprobs are the sampled floats (``SampledLogprobs``),
        else vLLM's per-position entries keyed by token."""
        ids = [int(t) for t in completion.token_ids]
        entries = completion.logprobs or []
        if len(entries) != len(ids):
            raise RuntimeError(f"the engine returned {len(entries)} logprobs for {len(ids)} tokens")
        if sampled_only:
            values = list(entries)
        else:
            values = [float(entry[token].logprob) for entry, token in zip(entries, ids, strict=True)]
        if delta:
            self.token_ids += ids
            self.logprobs += values
        else:
            self.token_ids, self.logprobs = ids, values


class CapturingEngineClient:
    """Delegates to ``inner`` (vLLM's ``AsyncLLM``); captures requests tagged with a scope."""

    def __init__(
        self,
        inner: Any,
        *,
        weight_version: int = 0,
        span_policy: SpanPolicy = SpanPolicy.RECORD,
        counters: CaptureCounters | None = None,
        logprob_path: LogprobPath = LogprobPath.SAMPLED,
    ) -> None:
        if weight_version < 0:
            raise ValueError(f"weight_version: must be >= 0, got {weight_version}")
        self._inner = inner
        self.span_policy = span_policy
        self.sampled_logprobs: SampledLogprobHook | None = None
        """On ``LogprobPath.SAMPLED``: the hook on the engine's output processor."""
        if logprob_path is LogprobPath.SAMPLED:
            self.sampled_logprobs = SampledLogprobHook.on(inner.output_processor)
        self.counters = counters if counters is not None else CaptureCounters()
        self.engine_errors = 0
        self._version = weight_version
        self._paused = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    # ------------------------------------------------------------------ versions

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def paused(self) -> bool:
        return self._paused

    async def update_weight_version(self, version: str) -> None:
        """Label the weights now loaded; calls entering from now on are stamped with it."""
        number = parse_weight_version(version)
        await self._inner.update_weight_version(str(number))
        self._version = number

    async def pause_generation(self, *args: Any, **kwargs: Any) -> None:
        await self._inner.pause_generation(*args, **kwargs)
        self._paused = True

    async def resume_generation(self, *args: Any, **kwargs: Any) -> None:
        await self._inner.resume_generation(*args, **kwargs)
        self._paused = False

    # ------------------------------------------------------------------ generation

    def generate(self, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        scope = prompt.pop(SCOPE_KEY, None) if isinstance(prompt, dict) else None
        if scope is None:
            return self._inner.generate(prompt, sampling_params, request_id, *args, **kwargs)
        return self._captured(scope, prompt, sampling_params, request_id, args, kwargs)

    async def _captured(
        self,
        scope: CaptureScope,
        prompt: dict[str, Any],
        sampling_params: Any,
        request_id: str,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
    ) -> AsyncIterator[Any]:
        version = self._version  # the version in effect when the call enters the engine
        scope.response_id = request_id  # vLLM's: the reply's id for chat and completions
        params, sampled_only = _with_sampled_logprob(sampling_params, self.sampled_logprobs is not None)
        sampling = provenance_of_params(sampling_params).extras()
        delta = _is_delta(params)
        prompt_ids = [int(t) for t in prompt.get("prompt_token_ids") or ()]
        choices: dict[int, _Choice] = {}
        outcome = WorkerFailure.CLIENT_DISCONNECTED  # unless the stream ends or the engine fails
        try:
            async for output in self._inner.generate(prompt, params, request_id, *args, **kwargs):
                if output.prompt_token_ids is not None:
                    prompt_ids = [int(t) for t in output.prompt_token_ids]
                for completion in output.outputs:
                    index = int(completion.index)
                    choice = choices.setdefault(index, _Choice())
                    choice.add(completion, delta=delta, sampled_only=sampled_only)
                    if completion.finish_reason in UNFINISHED:
                        scope.abandon(WorkerFailure.NOT_SERVED, version, index)
                    elif completion.finish_reason is not None:
                        self._finish(scope, index, prompt_ids, choice, completion, version, sampling)
                yield output
            outcome = WorkerFailure.NOT_SERVED  # the stream ended: a choice not finished was aborted
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except BaseException:
            self.engine_errors += 1
            outcome = WorkerFailure.NOT_SERVED
            raise
        finally:
            scope.abandon(outcome, version)

    def _finish(
        self,
        scope: CaptureScope,
        index: int,
        prompt_ids: Sequence[int],
        choice: _Choice,
        completion: Any,
        version: int,
        sampling: dict[str, Any],
    ) -> None:
        """Capture a finished choice (synchronous, no I/O), with its sampling provenance
        and its weight spans if a refit landed."""
        failure: WorkerFailure | None = None
        extras: dict[str, Any] = {EXTRAS_SAMPLING: sampling}  # {} when neutral: known, not absent
        try:
            spans = weight_spans(getattr(completion, "weight_versions", None) or (), version)
        except InvalidWeightVersion as exc:
            log.warning("capture of choice %d fails: %s", index, exc)
            failure = WorkerFailure.EPOCH_SPAN_REJECTED
        else:
            if spans is not None:
                self.counters.refit_straddles += 1
                if self.span_policy is SpanPolicy.REJECT:
                    failure = WorkerFailure.EPOCH_SPAN_REJECTED
                extras[EXTRAS_WEIGHT_SPANS] = spans
        scope.capture(
            index,
            prompt_ids,
            choice.token_ids,
            choice.logprobs,
            weight_version=version,
            extras=extras or None,
            failure=failure,
        )


def _with_sampled_logprob(params: Any, sampled_path: bool) -> tuple[Any, bool]:
    """Parameters that return at least the sampled token's logprob (the row needs it), and
    whether its outputs carry that float alone: on the sampled path, a request that did
    not ask for logprobs is marked for ``SampledLogprobs``."""
    if getattr(params, "logprobs", None) is not None:
        return params, False
    params = params.clone()
    params.logprobs = 0
    if sampled_path:
        params.extra_args = {**(params.extra_args or {}), SAMPLED_ONLY: True}
    return params, sampled_path


def _is_delta(params: Any) -> bool:
    return str(getattr(getattr(params, "output_kind", None), "name", "")) == "DELTA"


def weight_spans(spans: Sequence[Any], admission_version: int) -> list[list[int]] | None:
    """``[[generated_offset, version], ...]`` when any token came from other weights, else None.

    ``spans`` carry ``version``, ``start`` and ``end`` (vLLM's weight-version spans).
    Empty spans are dropped and neighbours with one version merged; tokens before the
    first labelled span belong to the admission version. Raises ``InvalidWeightVersion``
    for a label that is not a non-negative integer.
    """
    pairs: list[list[int]] = []
    for span in spans:
        if span.end <= span.start:
            continue
        version = parse_weight_version(span.version)
        if pairs and pairs[-1][1] == version:
            continue
        pairs.append([int(span.start), version])
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
    "SCOPE_KEY",
    "CapturingEngineClient",
    "InvalidWeightVersion",
    "LogprobPath",
    "SpanPolicy",
    "parse_weight_version",
    "tag_engine_input",
    "weight_spans",
]
