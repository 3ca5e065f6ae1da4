"""vLLM's ``AsyncLLM`` behind a small token-in interface.

Everything vLLM-specific the worker needs lives here: start-up arguments, token-in
generation with the sampled token's logprob, and the refit controls (pause, reload
weights, label the weight version, resume). The worker logic (template, splice,
capture) talks to the ``stages.capture.engine.TokenEngine`` protocol only, so it is tested without an engine
and survives vLLM API changes in one place. vLLM is imported lazily and typed loosely:
importing this module stays cheap and type checking never walks vLLM's sources.

Logprobs: the engine runs with ``logprobs_mode="processed_logprobs"``, so the logprob
recorded for each generated token is taken from the distribution the token was
actually sampled from, i.e. ``log_softmax(logits / temperature)`` after top-k/top-p
filtering (greedy decoding: of the plain logits). That is the behaviour policy a
trainer's importance ratios need; the ``raw_*`` modes would record the unscaled model
distribution instead, which differs whenever temperature or top-p is not neutral.

Weight versions: vLLM labels every output token with the version set by
``update_weight_version`` when the token was produced and reports contiguous spans
on the final output; it stamps nothing at admission, so the worker, which is the one
changing versions, remembers the version in effect itself.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stages.capture.engine import (
    EngineRequestError,
    EngineUnavailable,
    Generation,
    Sampling,
    VersionSpan,
)

log = logging.getLogger(__name__)

LOGPROBS_MODE = "processed_logprobs"


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """How to start the engine; ``extra`` passes further ``AsyncEngineArgs`` fields through."""

    model: str
    dtype: str = "float32"
    max_model_len: int = 4096
    kv_cache_memory_bytes: int | None = 64 * 2**20
    enforce_eager: bool = True
    seed: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)

    def engine_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "model": self.model,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "enforce_eager": self.enforce_eager,
            "seed": self.seed,
            "logprobs_mode": LOGPROBS_MODE,
            "disable_log_stats": True,
        }
        if self.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        kwargs.update(self.extra)
        if kwargs["logprobs_mode"] != LOGPROBS_MODE:
            raise ValueError(
                f"logprobs_mode: capture records {LOGPROBS_MODE}, got {kwargs['logprobs_mode']!r}"
            )
        return kwargs


class VllmEngine:
    """``TokenEngine`` on vLLM's ``AsyncLLM``; create it inside the event loop that will use it."""

    def __init__(self, llm: Any, settings: EngineSettings) -> None:
        self._llm: Any = llm
        self.settings = settings

    @classmethod
    def start(cls, settings: EngineSettings) -> VllmEngine:
        """Build the engine (blocking: tens of seconds on CPU). Call from the serving loop."""
        async_llm = importlib.import_module("vllm.v1.engine.async_llm")
        arg_utils = importlib.import_module("vllm.engine.arg_utils")
        args = arg_utils.AsyncEngineArgs(**settings.engine_kwargs())
        log.info("starting the vLLM engine for %s", settings.model)
        # No local name for the engine: vLLM keeps this frame alive (a captured stack),
        # and a local would keep the engine alive past ``shutdown`` until interpreter exit.
        return cls(async_llm.AsyncLLM.from_engine_args(args), settings)

    @property
    def max_model_len(self) -> int:
        return self.settings.max_model_len

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling, request_id: str) -> Generation:
        inputs = importlib.import_module("vllm.inputs")
        params_module = importlib.import_module("vllm.sampling_params")
        exceptions = importlib.import_module("vllm.exceptions")
        try:
            params = params_module.SamplingParams(
                max_tokens=sampling.max_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                seed=sampling.seed,
                stop=list(sampling.stop) or None,
                ignore_eos=sampling.ignore_eos,
                logprobs=0,  # the sampled token only
                output_kind=params_module.RequestOutputKind.FINAL_ONLY,
            )
        except (ValueError, TypeError, exceptions.VLLMClientError) as exc:
            raise EngineRequestError(str(exc)) from None
        prompt = inputs.TokensPrompt(prompt_token_ids=[int(t) for t in prompt_ids])
        final: Any = None
        try:
            async for output in self._live().generate(prompt, params, request_id=request_id):
                final = output
        except (ValueError, exceptions.VLLMClientError) as exc:
            raise EngineRequestError(str(exc)) from None
        except exceptions.VLLMError as exc:
            raise EngineUnavailable(f"{type(exc).__name__}: {exc}") from exc
        if final is None or not final.outputs:
            raise EngineUnavailable(f"request {request_id} finished without an output")
        return _generation(final.outputs[0])

    async def pause(self) -> None:
        # "keep" freezes in-flight requests; clearing the cache makes them recompute their
        # KV with the new weights, so tokens after a refit really come from those weights.
        await self._live().pause_generation(mode="keep", clear_cache=True)

    async def resume(self) -> None:
        await self._live().resume_generation()

    async def reload_weights(self, path: str) -> None:
        try:
            await self._live().collective_rpc(
                "reload_weights", kwargs={"weights_path": path, "is_checkpoint_format": True}
            )
        except EngineUnavailable:
            raise
        except Exception as exc:
            raise EngineUnavailable(f"reloading weights from {path} failed: {exc}") from exc

    async def set_weight_version(self, version: str) -> None:
        await self._live().update_weight_version(version)

    def unfinished_requests(self) -> int:
        return 0 if self._llm is None else int(self._llm.get_num_unfinished_requests())

    def _live(self) -> Any:
        if self._llm is None:
            raise EngineUnavailable("the engine is shut down")
        return self._llm

    def shutdown(self) -> None:
        """Stop the engine processes now (idempotent).

        The reference is dropped too, so vLLM's own finalizer runs here rather than at
        interpreter teardown, where it fails noisily on half-destroyed modules.
        """
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()
            del llm


def _generation(completion: Any) -> Generation:
    """Our view of a vLLM ``CompletionOutput``: one logprob per token, spans as plain tuples."""
    token_ids = [int(t) for t in completion.token_ids]
    entries = completion.logprobs or []
    if len(entries) != len(token_ids):
        raise EngineUnavailable(f"engine returned {len(entries)} logprobs for {len(token_ids)} tokens")
    logprobs = [float(entry[token].logprob) for entry, token in zip(entries, token_ids, strict=True)]
    spans = tuple(
        VersionSpan(str(span.version), int(span.start), int(span.end))
        for span in (getattr(completion, "weight_versions", None) or [])
    )
    return Generation(
        token_ids=token_ids,
        logprobs=logprobs,
        text=str(completion.text or ""),
        finish_reason=None if completion.finish_reason is None else str(completion.finish_reason),
        version_spans=spans,
    )


__all__ = ["LOGPROBS_MODE", "EngineSettings", "VllmEngine"]
