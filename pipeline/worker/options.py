"""Every request option is honoured or refused: nothing is silently ignored.

vLLM's request models accept unknown fields (and log them at debug level), and some
fields they know have no effect on this worker (disaggregated serving, multimodal
inputs, GPU-only watermarking, stored responses). A request naming any of those gets a
400 naming the parameter before anything is rendered or captured. Some options are
fine on their own but would make the captured call inexact; they are refused only
when the request carries ``ng_capture``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from pipeline.api.errors import InvalidRequest
from pipeline.api.protocols import Protocol
from topics.wire import CAPTURE_FIELD


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a field is refused, and for which values (default: any value but null)."""

    reason: str
    refused: Callable[[Any], bool] = lambda value: value is not None
    captured_only: bool = False


def _truthy(value: Any) -> bool:
    return bool(value)


def _is_false(value: Any) -> bool:
    return value is False


_NOT_HERE = "not available on this worker"
_TEXT_ONLY = "the model is text-only"
_INEXACT = "a captured call must be generated from the exact, whole prompt"

COMMON: dict[str, Refusal] = {
    "kv_transfer_params": Refusal(f"disaggregated prefill is {_NOT_HERE}"),
    "ec_transfer_params": Refusal(f"disaggregated encoding is {_NOT_HERE}"),
    "mm_payload": Refusal(_TEXT_ONLY),
    "media_io_kwargs": Refusal(_TEXT_ONLY),
    "mm_processor_kwargs": Refusal(_TEXT_ONLY),
    "return_mm_kwargs": Refusal(_TEXT_ONLY, _truthy),
    "watermarking": Refusal(f"watermarking is {_NOT_HERE} (GPU engines only)", _truthy),
    "vllm_xargs": Refusal(f"no logits-processor plugin that reads it is {_NOT_HERE}"),
    "routed_experts_prompt_start": Refusal(f"routed-expert capture is {_NOT_HERE}"),
    "use_beam_search": Refusal("beam search does not sample: there are no sampled logprobs", _truthy, True),
    "truncate_prompt_tokens": Refusal(_INEXACT, captured_only=True),
    "prompt_embeds": Refusal("embeddings have no token ids to capture", captured_only=True),
    "continue_final_message": Refusal(_INEXACT, _truthy, True),
    "add_generation_prompt": Refusal(_INEXACT, _is_false, True),
}

RESPONSES: dict[str, Refusal] = {
    "store": Refusal("this worker does not store responses; send store=false", _truthy),
    "background": Refusal("background responses need stored responses", _truthy),
    "previous_response_id": Refusal("this worker does not store responses; send the history in input"),
    "service_tier": Refusal(f"service tiers are {_NOT_HERE}"),
    "metadata": Refusal("metadata is kept with stored responses, which this worker does not keep"),
    "prompt": Refusal(f"stored prompt templates are {_NOT_HERE}"),
    "prompt_cache_key": Refusal(f"prompt cache keys are {_NOT_HERE}"),
    "truncation": Refusal(
        "the worker never drops input items; send truncation='disabled'", lambda v: v == "auto"
    ),
    "max_tool_calls": Refusal(f"built-in tools are {_NOT_HERE}"),
}


def field_names(model: type[BaseModel]) -> frozenset[str]:
    names: set[str] = set()
    for name, info in model.model_fields.items():
        names.add(name)
        if info.alias:
            names.add(info.alias)
    return frozenset(names)


def check_options(
    body: Mapping[str, Any],
    known: frozenset[str],
    refusals: Mapping[str, Refusal],
    *,
    captured: bool,
) -> None:
    """Raise ``InvalidRequest`` for the first unknown or refused field of ``body``."""
    for name, value in body.items():
        if name == CAPTURE_FIELD:
            continue
        if name not in known:
            raise InvalidRequest(name, f"{name}: unknown parameter")
        refusal = refusals.get(name)
        if refusal is not None and refusal.refused(value) and (captured or not refusal.captured_only):
            when = " with ng_capture" if refusal.captured_only else ""
            raise InvalidRequest(name, f"{name}: not supported{when}: {refusal.reason}")


def check_content(body: Mapping[str, Any], protocol: Protocol) -> None:
    """Non-text content (images, audio, files) is refused, naming the part's ``type``."""
    for path, kind in protocol.content_part_types(body):
        if kind not in protocol.text_parts:
            raise InvalidRequest(path, f"{path}: {kind!r} content is not supported: {_TEXT_ONLY}")


__all__ = ["COMMON", "RESPONSES", "Refusal", "check_content", "check_options", "field_names"]
