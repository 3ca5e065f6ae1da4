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

from stages.capture.splice import SpliceError, splice_prefix

Message = Mapping[str, Any]
RENDER_OWNED = frozenset(
    {"add_generation_prompt", "continue_final_message", "tools", "tokenize", "chat_template", "return_dict"}
)
"""Template arguments the renderer sets itself; a request's kwargs never override them."""
Tool = Mapping[str, Any]


class ChatRenderer:
    """Renders conversations to ids with a Hugging Face tokenizer's chat template."""

    def __init__(
        self, tokenizer: Any, eos_token_ids: Collection[int], *, chat_template: str | None = None
    ) -> None:
        if not eos_token_ids:
            raise ValueError("eos_token_ids: at least one end-of-turn id is required")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, chat_template: str | None = None) -> ChatRenderer:
        """The tokenizer vLLM serves, and every id that ends a generation for this model.

        ``chat_template`` overrides the tokenizer's, as it does for the server's render.
        """
        transformers = importlib.import_module("transformers")
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
        return cls(tokenizer, eos_token_ids_of(Path(model_dir), tokenizer), chat_template=chat_template)

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

    def render_history(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int] | None:
        """The conversation through its last assistant turn, or None if it has none."""
        last = last_assistant_index(messages)
        if last is None:
            return None
        return self._ids(messages[: last + 1], tools, template_kwargs, add_generation_prompt=False)

    def spliced(
        self,
        exact_prefix: Sequence[int],
        messages: Sequence[Message],
        tools: Sequence[Tool] | None,
        full: Sequence[int],
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The prompt to send for a continuation: exact prefix, then the template's new tail.

        ``template_kwargs`` are the template variables ``full`` was rendered with (thinking
        on or off, ...): the history is rendered with the same ones. Raises ``SpliceError``
        when the conversation has no assistant turn or the EOS count cannot be matched.
        """
        history = self.render_history(messages, tools, template_kwargs)
        if history is None:
            raise SpliceError("a continuation needs an assistant turn in its messages")
        return splice_prefix(exact_prefix, history, full, self.eos_token_ids)

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


def last_assistant_index(messages: Sequence[Message]) -> int | None:
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].get("role") == "assistant":
            return index
    return None


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


__all__ = ["ChatRenderer", "eos_token_ids_of", "last_assistant_index"]
