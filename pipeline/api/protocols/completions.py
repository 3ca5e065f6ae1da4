"""OpenAI Completions (``/v1/completions``).

The history is the prompt text itself, compared by character prefix: a string prompt
only (token-id and batched prompts have no text to compare). A reply is each choice's
``text`` as an assistant turn; a stream is rebuilt per choice from its text pieces.
Its requests hold no content parts.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from pipeline.api.protocols.choices import ChoicesProtocol, choices
from pipeline.api.protocols.stream import ReplyTurns, StreamedReply, append, dicts, index_or
from pipeline.api.protocols.turns import Turn, malformed, optional_str


class Completions(ChoicesProtocol):
    name = "completions"
    path = "/v1/completions"
    turn_list = None
    text_parts = frozenset()

    def history(self, body: Mapping[str, Any]) -> str:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise malformed("prompt", "must be a string (token-id and batched prompts are not supported)")
        return prompt

    def reply_turns(self, reply: Mapping[str, Any]) -> dict[int, Turn]:
        return {
            index: Turn("assistant", optional_str(choice.get("text"), f"{param}.text"))
            for index, choice, param in choices(reply)
        }

    def streamed_reply(self) -> StreamedReply:
        return _CompletionsStream(self.reply_turns)

    def content_part_types(self, body: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
        return iter(())


class _CompletionsStream(StreamedReply):
    """Each choice's text pieces, by choice index."""

    def __init__(self, reply_turns: ReplyTurns) -> None:
        super().__init__(reply_turns)
        self._texts: dict[int, list[str]] = {}

    def _take(self, name: Any, data: Mapping[str, Any]) -> None:
        for j, choice in dicts(data.get("choices")):
            append(self._texts.setdefault(index_or(choice.get("index"), j), []), choice.get("text"))

    def reply(self) -> Mapping[str, Any] | None:
        if not self._texts:
            return None
        return {"choices": [{"index": i, "text": "".join(parts)} for i, parts in sorted(self._texts.items())]}


__all__ = ["Completions"]
