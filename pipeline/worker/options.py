"""Every request option is honoured or refused: nothing is silently ignored.

vLLM's request models accept unknown fields (and log them at debug level), and some
fields they know have no effect on this worker (disaggregated serving, multimodal
inputs, GPU-only watermarking, stored responses). A request naming any of those gets a
400 naming the parameter before anything is rendered or captured. Some options are
fine on their own but would make the captured call inexact; they are refused only
when the request carries ``ng_capture``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from pipeline.api.errors import InvalidRequest
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

TEXT_PARTS = {
    "chat": frozenset({"text", "refusal"}),
    # reasoning_text and summary_text: a reply's own reasoning item, sent back as it came.
    "responses": frozenset(
        {"input_text", "output_text", "refusal", "text", "reasoning_text", "summary_text"}
    ),
    "messages": frozenset({"text", "tool_use", "tool_result", "thinking", "redacted_thinking"}),
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


def check_content(body: Mapping[str, Any], dialect: str) -> None:
    """Non-text content (images, audio, files) is refused, naming the part's ``type``."""
    allowed = TEXT_PARTS[dialect]
    for path, kind in _part_types(body, dialect):
        if kind not in allowed:
            raise InvalidRequest(path, f"{path}: {kind!r} content is not supported: {_TEXT_ONLY}")


def _part_types(body: Mapping[str, Any], dialect: str) -> Iterator[tuple[str, Any]]:
    if dialect == "responses":
        items = body.get("input")
        if isinstance(items, list):
            yield from _parts_of(items, "input", "content")
        return
    messages = body.get("messages")
    if isinstance(messages, list):
        yield from _parts_of(messages, "messages", "content")
    if dialect == "messages" and isinstance(body.get("system"), list):
        for j, part in enumerate(body["system"]):
            if isinstance(part, Mapping):
                yield f"system[{j}].type", part.get("type")


def _parts_of(items: list[Any], root: str, key: str) -> Iterator[tuple[str, Any]]:
    for i, item in enumerate(items):
        content = item.get(key) if isinstance(item, Mapping) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, Mapping):
                continue
            yield f"{root}[{i}].{key}[{j}].type", part.get("type")
            nested = part.get("content")
            if part.get("type") == "tool_result" and isinstance(nested, list):
                for k, inner in enumerate(nested):
                    if isinstance(inner, Mapping):
                        yield f"{root}[{i}].{key}[{j}].content[{k}].type", inner.get("type")


__all__ = ["COMMON", "RESPONSES", "Refusal", "check_content", "check_options", "field_names"]
