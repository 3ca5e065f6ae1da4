"""vLLM's ``AsyncLLM``: how it is started, shut down and loaded with new weights.

The start-up arguments capture depends on live here; serving goes through vLLM's own
serving layers on the capturing client (``stages.capture.vllm.client``). vLLM is
imported lazily: importing this module stays cheap.

Logprobs: the engine runs with ``logprobs_mode="processed_logprobs"``, so the logprob
recorded for each generated token is taken from the distribution the token was
actually sampled from, i.e. ``log_softmax(logits / temperature)`` after top-k/top-p
filtering (greedy decoding: of the plain logits). That is the behaviour policy a
trainer's importance ratios need; the ``raw_*`` modes would record the unscaled model
distribution instead, which differs whenever temperature or top-p is not neutral.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

LOGPROBS_MODE = "processed_logprobs"

SHUTDOWN_GRACE_S = 1.0
"""How long ``shutdown`` lets vLLM's engine-core process exit after SIGTERM before vLLM
kills it. The engine core keeps nothing that outlives it (crash-only: it must survive
``kill -9`` anyway), and on CPU it does not exit on SIGTERM within vLLM's default 5 s,
so a longer grace only delays every stop by the difference."""


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """How to start the engine; ``extra`` passes further ``AsyncEngineArgs`` fields through."""

    model: str
    dtype: str = "float32"
    max_model_len: int = 4096
    kv_cache_memory_bytes: int | None = 64 * 2**20
    enforce_eager: bool = True
    seed: int = 0
    tokenizer_mode: str = "auto"
    """vLLM's: ``auto``, ``hf`` (the chat template) or ``mistral`` (mistral_common)."""
    sampled_logprob_sampler: bool = True
    """Run vLLM's worker with capture's sampler hook (``stages.capture.vllm.sampler``):
    the sampled token's logprob without vLLM's general top-k path."""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def engine_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "model": self.model,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "enforce_eager": self.enforce_eager,
            "seed": self.seed,
            "tokenizer_mode": self.tokenizer_mode,
            "logprobs_mode": LOGPROBS_MODE,
            "disable_log_stats": True,
        }
        if self.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        if self.sampled_logprob_sampler:
            kwargs["worker_cls"] = capture_worker_cls()
        kwargs.update(self.extra)
        if kwargs["logprobs_mode"] != LOGPROBS_MODE:
            raise ValueError(
                f"logprobs_mode: capture records {LOGPROBS_MODE}, got {kwargs['logprobs_mode']!r}"
            )
        return kwargs


def capture_worker_cls() -> str:
    """vLLM's worker for this host with capture's sampler hook, as vLLM's ``worker_cls``."""
    platforms = importlib.import_module("vllm.platforms")
    kind = "CPU" if platforms.current_platform.is_cpu() else "GPU"
    return f"stages.capture.vllm.sampler.Capture{kind}Worker"


class EngineUnavailable(RuntimeError):
    """The engine is shut down or failed an operation: a server error."""


class VllmEngine:
    """vLLM's ``AsyncLLM``, started and shut down; create it inside the event loop that will use it."""

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

    @property
    def llm(self) -> Any:
        """The running ``AsyncLLM``: the engine client vLLM's serving layers call."""
        return self._live()

    async def reload_weights(self, path: str) -> None:
        try:
            await self._live().collective_rpc(
                "reload_weights", kwargs={"weights_path": path, "is_checkpoint_format": True}
            )
        except EngineUnavailable:
            raise
        except Exception as exc:
            raise EngineUnavailable(f"reloading weights from {path} failed: {exc}") from exc

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
            llm.shutdown(timeout=SHUTDOWN_GRACE_S)
            del llm


__all__ = ["LOGPROBS_MODE", "SHUTDOWN_GRACE_S", "EngineSettings", "EngineUnavailable", "VllmEngine"]
