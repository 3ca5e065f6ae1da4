"""The history render behind the splice: the model's template, through the last assistant turn.

vLLM renders the prompt it serves. For a call that continues a captured conversation the
earlier turns must be the exact ids the model saw and produced, not their re-rendering
(templates strip reasoning, tokenizers merge differently): the render of the history
through the last assistant turn, with the same template, tells the splice how many
turn-closing EOS tokens of vLLM's render to replace by the exact prefix (DESIGN §5).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from stages.capture.splice import SpliceError, splice_prefix, turns_closed

Message = Mapping[str, Any]
RENDER_OWNED = frozenset(
    {"add_generation_prompt", "continue_final_message", "tools", "tokenize", "chat_template", "return_dict"}
)
"""Template arguments the renderer sets itself; a request's kwargs never override them."""
Tool = Mapping[str, Any]


class ChatRenderer:
    """Renders conversations to ids with a Hugging Face tokenizer's chat template."""

    tokenizer_mode = "hf"
    """vLLM's tokenizer mode this renders as: ``hf`` renders vLLM's parsed conversation with
    the template; ``mistral`` (``vllm.mistral``) encodes the request's messages as sent."""

    def __init__(
        self,
        tokenizer: Any,
        eos_token_ids: Collection[int],
        *,
        chat_template: str | None = None,
        family: str = "unknown",
    ) -> None:
        if not eos_token_ids:
            raise ValueError("eos_token_ids: at least one end-of-turn id is required")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.family = family
        """The template's family, named in splice-failure logs and metrics."""

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, *, chat_template: str | None = None, family: str = "unknown"
    ) -> ChatRenderer:
        """The tokenizer vLLM serves, and every id that ends a generation for this model.

        ``chat_template`` overrides the tokenizer's, as it does for the server's render.
        """
        transformers = importlib.import_module("transformers")
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
        return cls(
            tokenizer,
            eos_token_ids_of(Path(model_dir), tokenizer),
            chat_template=chat_template,
            family=family,
        )

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The full prompt: every message, then the assistant generation prompt."""
        return self._ids(messages, tools, template_kwargs, add_generation_prompt=True)

    def encode(self, text: str) -> list[int]:
        """Plain text to ids, without special tokens (the tail of a completion prompt)."""
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    @property
    def template_text(self) -> str | None:
        """The template renders use: the override, else the tokenizer's own."""
        return self.chat_template or getattr(self.tokenizer, "chat_template", None)

    def spliced(
        self,
        exact_prefix: Sequence[int],
        messages: Sequence[Message],
        tools: Sequence[Tool] | None,
        full: Sequence[int],
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The prompt to send for a continuation: exact prefix, then the template's new tail.

        The history ends at the assistant turn the exact prefix ends with: the last one,
        or an earlier one when an agent added assistant turns the engine never produced
        (their render then closes more turns than the prefix does). Raises
        ``SpliceError`` when the conversation has no assistant turn or no assistant turn
        closes as many turns as the exact prefix. ``template_kwargs`` are the template
        variables ``full`` was rendered with (thinking on or off, ...): the history is
        rendered with the same ones.

        A render that already starts with the exact prefix, which ends on a turn-closing
        token (an append-only template, the model's reply re-rendered as it was produced),
        is the splice's own result: it is sent as it is, without rendering the history, so
        the call costs nothing that grows with the conversation beyond that comparison.
        """
        if starts_with_exact_prefix(full, exact_prefix, self.eos_token_ids):
            return list(full)
        closed = turns_closed(exact_prefix, self.eos_token_ids) if exact_prefix else 0
        history: list[int] | None = None
        for index in assistant_indices(messages):
            history = self._ids(messages[: index + 1], tools, template_kwargs, add_generation_prompt=False)
            if self._count_eos(history) <= closed:
                break
        if history is None:
            raise SpliceError("a continuation needs an assistant turn in its messages")
        return splice_prefix(exact_prefix, history, full, self.eos_token_ids)

    def _count_eos(self, ids: Sequence[int]) -> int:
        return sum(1 for token in ids if token in self.eos_token_ids)

    def _ids(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool] | None,
        template_kwargs: Mapping[str, Any] | None,
        *,
        add_generation_prompt: bool,
    ) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=[dict(t) for t in tools] if tools else None,
            add_generation_prompt=add_generation_prompt,
            chat_template=self.chat_template,
            tokenize=True,
            return_dict=False,
            **{k: v for k, v in (template_kwargs or {}).items() if k not in RENDER_OWNED},
        )
        return [int(t) for t in ids]


def assistant_indices(messages: Sequence[Message]) -> list[int]:
    """Indices of the assistant messages, latest first."""
    return [i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == "assistant"]


def template_family(model_dir: Path) -> str:
    """What to call a model's own template in logs and metrics, read from its files.

    A tiny model records the family it was built with (``tinymodel.json``); any other
    model is named by config.json's ``model_type``.
    """
    for name, path in (("tinymodel.json", ("spec", "template")), ("config.json", ("model_type",))):
        try:
            value: Any = json.loads((model_dir / name).read_text())
            for key in path:
                value = value.get(key) if isinstance(value, dict) else None
        except (OSError, ValueError):
            continue
        if isinstance(value, str) and value:
            return value
    return "unknown"


def starts_with_exact_prefix(full: Sequence[int], exact_prefix: Sequence[int], eos: Collection[int]) -> bool:
    """``full`` begins with the whole exact prefix, which ends on a turn-closing token."""
    size = len(exact_prefix)
    return bool(size) and exact_prefix[-1] in eos and len(full) > size and full[:size] == exact_prefix


def eos_token_ids_of(model_dir: Path, tokenizer: Any) -> list[int]:
    """The tokenizer's EOS plus the ``eos_token_id`` of config.json and generation_config.json.

    These are the ids on which the engine stops, so a generation can end on any of them.
    """
    found: list[int] = []

    def add(value: Any) -> None:
        values = value if isinstance(value, list) else [value]
        for item in values:
            if type(item) is int and item not in found:
                found.append(item)

    add(getattr(tokenizer, "eos_token_id", None))
    for name in ("generation_config.json", "config.json"):
        try:
            add(json.loads((model_dir / name).read_text()).get("eos_token_id"))
        except (OSError, ValueError, AttributeError):
            continue
    return found


__all__ = [
    "ChatRenderer",
    "assistant_indices",
    "eos_token_ids_of",
    "starts_with_exact_prefix",
    "template_family",
]
