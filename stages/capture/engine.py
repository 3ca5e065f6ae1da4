"""What capture needs from an inference engine, whichever engine it is.

The worker logic (template, splice, capture) talks to ``TokenEngine`` only, so it is
tested without an engine and each engine adapter (``stages.capture.vllm``) keeps its
engine's API in one place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Sampling:
    """The sampling parameters a chat request may set."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class VersionSpan:
    """Generated tokens ``[start, end)`` came from the weights labelled ``version``."""

    version: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Generation:
    """One finished generation: ids, the sampled tokens' logprobs, text and version spans."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None
    version_spans: tuple[VersionSpan, ...] = ()


class EngineRequestError(ValueError):
    """The engine refused the request itself (too long, invalid parameters): a client error."""


class EngineUnavailable(RuntimeError):
    """The engine is dead or failed while generating: a server error."""


class TokenEngine(Protocol):
    """What the worker needs from an inference engine."""

    @property
    def max_model_len(self) -> int: ...

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling, request_id: str) -> Generation:
        """Generate from exact prompt ids; return only once the request finished."""
        ...

    async def pause(self) -> None:
        """Stop scheduling; in-flight requests are kept and continue after ``resume``."""

    async def resume(self) -> None: ...

    async def reload_weights(self, path: str) -> None:
        """Load a checkpoint directory into the running model (call while paused)."""

    async def set_weight_version(self, version: str) -> None:
        """Label the weights that produce tokens from now on."""

    def unfinished_requests(self) -> int: ...

    def shutdown(self) -> None: ...
