"""The history render for models vLLM serves through mistral_common (its ``mistral`` tokenizer mode).

Such a model has no Jinja template: vLLM's ``MistralTokenizer.apply_chat_template`` turns the
request's OpenAI-shaped messages into a mistral_common ``ChatCompletionRequest`` and encodes
it with the model's instruct tokenizer. The splice (DESIGN §5) needs the same encoding of the
history through the parent's assistant turn, which mistral_common refuses to encode for
serving (a conversation ending on a closed assistant turn is no request). So the history
goes through the same instruct tokenizer and request normalizer, with mistral_common's
pipeline-agnostic validator, which checks every message as serving does but enforces no
last role. The closed assistant turn then ends on ``</s>``, the only token Mistral's format
closes turns with, which is what the splice counts.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from stages.capture.chat import ChatRenderer, Message, Tool, eos_token_ids_of


class MistralChatRenderer(ChatRenderer):
    """Renders conversations with mistral_common, as vLLM's mistral tokenizer mode does.

    ``tokenizer`` is vLLM's ``MistralTokenizer``: the instance the engine's serving layers
    render with, so the full render is theirs and the history render shares its instruct
    tokenizer.
    """

    tokenizer_mode = "mistral"

    def __init__(self, tokenizer: Any, eos_token_ids: Collection[int], *, family: str = "unknown") -> None:
        super().__init__(tokenizer, eos_token_ids, family=family)
        from mistral_common.protocol.instruct.normalize import get_normalizer
        from mistral_common.protocol.instruct.validator import ValidationMode, get_validator
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        instruct = tokenizer.mistral.instruct_tokenizer
        version = instruct.tokenizer.version
        self._history = MistralTokenizer(
            instruct,
            validator=get_validator(version, mode=ValidationMode.agnostic),
            request_normalizer=get_normalizer(version, instruct.tokenizer.model_settings_builder),
        )

    @classmethod
    def of_engine(cls, tokenizer: Any, model_dir: Path, *, family: str = "unknown") -> MistralChatRenderer:
        """The renderer over the engine's own tokenizer, stopping where the engine stops."""
        return cls(tokenizer, eos_token_ids_of(model_dir, tokenizer), family=family)

    @property
    def template_text(self) -> str | None:
        """None: mistral_common has no template, and takes no template variables."""
        return None

    def _ids(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool] | None,
        template_kwargs: Mapping[str, Any] | None,
        *,
        add_generation_prompt: bool,
    ) -> list[int]:
        shaped = [dict(m) for m in messages]
        tool_dicts = [dict(t) for t in tools] if tools else None
        if add_generation_prompt:  # a request: vLLM's own call
            return [int(t) for t in self.tokenizer.apply_chat_template(shaped, tool_dicts)]
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        request = ChatCompletionRequest.from_openai(shaped, tools=tool_dicts)
        return [int(t) for t in self._history.encode_chat_completion(request).tokens]


__all__ = ["MistralChatRenderer"]
