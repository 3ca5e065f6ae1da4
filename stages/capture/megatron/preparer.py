"""The engine's ``prompt_preparer`` hook: exact prefixes resolved before admission, never waited on.

``MegatronPromptPreparer.prefetch`` resolves the prefix on the capture loop when the
request arrives, before it is submitted to the engine. ``prepare_prompt`` (inside the
step) only looks the result up; if the prefetch has not finished, it does not wait:
the call is served from its plain prompt and its capture fails ``prefix_unavailable``.
A ``token_in`` prompt that does not already start with the exact prefix is spliced
(DESIGN §5) from template renders the caller supplies.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from stages.capture.core import CaptureCore, PreparedCall, starts_with
from stages.capture.errors import CaptureFailure
from stages.capture.megatron.admission import (
    CAPTURE_KEY_FIELD,
    NO_PREFIX_IDS,
    admission_key,
    parse_admission,
)
from stages.capture.megatron.registry import PreparedCalls
from stages.capture.splice import SpliceError, splice_prefix
from topics.failures import WorkerFailure
from topics.records import CaptureAdmission
from topics.wire import CAPTURE_FIELD

log = logging.getLogger(__name__)

TEMPLATE_PREFIX_FIELD = "ng_template_prefix_ids"
"""Optional ``offload_params`` entry: the template render through the last assistant turn
(no generation prompt), for splicing a token-id prompt that is a full re-render."""

TemplateRenders = tuple[Sequence[int], Sequence[int]]
"""(render through the last assistant turn without generation prompt, full render sent)."""
Renderer = Callable[[Any, Mapping[str, Any]], TemplateRenders | None]


class PreparedPrompt(NamedTuple):
    """What ``prepare_prompt`` returns: the prompt to serve and the params to carry."""

    prompt: Any
    offload_params: Mapping[str, Any] | None


@dataclass(slots=True)
class PreparerStats:
    """How admitted calls were served (written on the engine's thread only)."""

    prepared: int = 0
    exact: int = 0  # token_in prompt already started with the exact prefix
    spliced: int = 0
    failed: Counter[str] = field(default_factory=Counter)


class MegatronPromptPreparer:
    """The engine's ``prompt_preparer``: exact prefixes resolved before admission, never waited on.

    ``prefetch`` runs on the capture loop (the loop of ``core``); ``prepare_prompt`` runs
    on the engine's thread. ``renderer(prompt, offload_params)`` may supply template renders
    for splicing; by default a token-id prompt is taken as the full render and
    ``offload_params[TEMPLATE_PREFIX_FIELD]`` as the render through the last assistant turn.
    """

    def __init__(
        self,
        core: CaptureCore,
        registry: PreparedCalls,
        *,
        eos_token_ids: Collection[int] = (),
        renderer: Renderer | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.core = core
        self.registry = registry
        self.eos_token_ids = frozenset(eos_token_ids)
        self.renderer = renderer or default_renders
        self.loop = loop
        self.stats = PreparerStats()

    async def prefetch(self, admission: CaptureAdmission | Mapping[str, Any]) -> PreparedCall:
        """Resolve the call's prefix; start it when the request arrives, before it is submitted."""
        parsed = admission if isinstance(admission, CaptureAdmission) else parse_admission(admission)
        key = parsed.staging_key
        self.registry.begin(key)
        try:
            prepared = await self.core.prepare(parsed)
        except BaseException as exc:
            failure = CaptureFailure(WorkerFailure.PREFIX_UNAVAILABLE, f"prefetch failed: {exc!r}")
            self.registry.resolve(key, PreparedCall(parsed, NO_PREFIX_IDS, None, failure))
            raise
        if not self.registry.resolve(key, prepared):
            log.info("prefix of %s resolved after the call was admitted; it was served without it", key)
        return prepared

    def prefetch_threadsafe(
        self, admission: CaptureAdmission | Mapping[str, Any]
    ) -> concurrent.futures.Future[PreparedCall]:
        """``prefetch`` scheduled on the capture loop from any thread."""
        if self.loop is None:
            raise RuntimeError("prefetch_threadsafe needs the capture loop (pass loop=...)")
        return asyncio.run_coroutine_threadsafe(self.prefetch(admission), self.loop)

    def prepare_prompt(self, prompt: Any, *, offload_params: Mapping[str, Any] | None) -> PreparedPrompt:
        """The prompt to serve. Synchronous, no I/O, never raises: capture never fails a request."""
        raw = offload_params.get(CAPTURE_FIELD) if isinstance(offload_params, Mapping) else None
        if raw is None or offload_params is None:
            return PreparedPrompt(prompt, offload_params)
        params = {k: v for k, v in offload_params.items() if k != TEMPLATE_PREFIX_FIELD}
        try:
            key = admission_key(raw)
            prepared = self._admitted(key, raw)
        except (ValueError, TypeError, KeyError) as exc:
            log.error("ng_capture is not a valid admission, serving without capture: %s", exc)
            return PreparedPrompt(prompt, params)
        params[CAPTURE_KEY_FIELD] = key
        try:
            served, prepared = self._splice(prompt, offload_params, prepared)
        except Exception as exc:  # a bug here must not fail the request
            log.exception("preparing the prompt of %s failed; serving it plain", key)
            served = prompt
            prepared = _failed(prepared, WorkerFailure.PREFIX_SPLICE_FAILED, repr(exc))
        self.stats.prepared += 1
        if prepared.failure is not None:
            self.stats.failed[prepared.failure.code.value] += 1
        self.registry.hold(key, prepared)
        return PreparedPrompt(served, params)

    def _admitted(self, key: str, raw: Any) -> PreparedCall:
        started, prepared = self.registry.claim(key)
        if prepared is not None:
            return prepared
        admission = raw if isinstance(raw, CaptureAdmission) else parse_admission(raw)
        if admission.mode == "text":
            return PreparedCall(admission, NO_PREFIX_IDS, None)  # a root call has no prefix to wait for
        reason = "prefix still resolving at admission" if started else "no prefetch was started"
        return PreparedCall(
            admission, NO_PREFIX_IDS, None, CaptureFailure(WorkerFailure.PREFIX_UNAVAILABLE, reason)
        )

    def _splice(
        self, prompt: Any, offload_params: Mapping[str, Any], prepared: PreparedCall
    ) -> tuple[Any, PreparedCall]:
        if prepared.failure is not None or prepared.admission.mode == "text":
            return prompt, prepared
        prefix = prepared.prefix_ids
        ids = prompt_ids(prompt)
        if ids is not None and starts_with(ids, prefix):
            self.stats.exact += 1
            return prompt, prepared
        if prepared.admission.history == "render":  # served as rendered: capture starts a segment
            return prompt, prepared
        renders = self.renderer(prompt, offload_params)
        if renders is None:
            detail = "prompt does not start with the exact prefix and no template renders were given"
            return prompt, _failed(prepared, WorkerFailure.PREFIX_SPLICE_FAILED, detail)
        template_prefix_ids, template_ids = renders
        try:
            spliced = splice_prefix(prefix.tolist(), template_prefix_ids, template_ids, self.eos_token_ids)
        except SpliceError as exc:
            return prompt, _failed(prepared, WorkerFailure.PREFIX_SPLICE_FAILED, exc.reason)
        self.stats.spliced += 1
        return spliced, prepared


def default_renders(prompt: Any, offload_params: Mapping[str, Any]) -> TemplateRenders | None:
    """A token-id prompt as the full render, with the history render from ``offload_params``."""
    history = offload_params.get(TEMPLATE_PREFIX_FIELD)
    ids = prompt_ids(prompt)
    if history is None or ids is None:
        return None
    return list(history), ids


def prompt_ids(prompt: Any) -> list[int] | None:
    """A prompt given as token ids (list, array or tensor), else None (text)."""
    if isinstance(prompt, str):
        return None
    if isinstance(prompt, list):
        return prompt  # read only: never copied on the engine's path
    if hasattr(prompt, "tolist"):
        converted = prompt.tolist()
        return converted if isinstance(converted, list) else None
    if isinstance(prompt, tuple):
        return list(prompt)
    return None


def _failed(prepared: PreparedCall, code: WorkerFailure, detail: str) -> PreparedCall:
    return dataclasses.replace(prepared, failure=CaptureFailure(code, detail))


__all__ = [
    "TEMPLATE_PREFIX_FIELD",
    "MegatronPromptPreparer",
    "PreparedPrompt",
    "PreparerStats",
    "default_renders",
]
