"""OpenAI Chat Completions (``/v1/chat/completions``).

Turns: ``messages[i]`` by role (``developer`` counts as ``system``); a ``{"role": "tool"}``
message is one ``"tool"`` turn (its content's text); an assistant's
``tool_calls[j].function.{name, arguments}`` are its tool calls, its ``refusal`` counts as
text, and a reasoning field (``reasoning``, ``reasoning_content``) is ignored. A reply is
one assistant turn per choice; a stream is rebuilt per choice from its deltas.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

from pipeline.api.protocols.base import part_types
from pipeline.api.protocols.choices import ChoicesProtocol, choices
from pipeline.api.protocols.stream import Piece, ReplyTurns, StreamedReply, append, dicts, index_or
from pipeline.api.protocols.turns import (
    CONVERSATION_ROLES,
    REASONING_FIELDS,
    Turn,
    canonical,
    content_text,
    mapping,
    optional_list,
    optional_str,
    required_list,
    role,
    tool_call,
)

_ROLES = {**CONVERSATION_ROLES, "tool": "tool"}


class Chat(ChoicesProtocol):
    name = "chat"
    path = "/v1/chat/completions"
    turn_list = "messages"
    text_parts = frozenset({"text", "refusal"})

    def history(self, body: Mapping[str, Any]) -> list[Turn]:
        messages = required_list(body.get("messages"), "messages")
        return canonical(
            replace(_turn(message, f"messages[{i}]"), source=i) for i, message in enumerate(messages)
        )

    def reply_turns(self, reply: Mapping[str, Any]) -> dict[int, Turn]:
        return {
            index: canonical([_turn(choice.get("message"), f"{param}.message", assistant=True)])[0]
            for index, choice, param in choices(reply)
        }

    def streamed_reply(self) -> StreamedReply:
        return _ChatStream(self.reply_turns)

    def content_part_types(self, body: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
        messages = body.get("messages")
        if isinstance(messages, list):
            yield from part_types(messages, "messages", "content")


def _turn(message: Any, param: str, *, assistant: bool = False) -> Turn:
    message = mapping(message, param)
    said = "assistant" if assistant else role(_ROLES, message.get("role"), f"{param}.role")
    text = content_text(message.get("content"), f"{param}.content")
    if said != "assistant":
        return Turn(said, text)
    text += optional_str(message.get("refusal"), f"{param}.refusal")
    reasoned = any(isinstance(message.get(name), str) and message.get(name) for name in REASONING_FIELDS)
    calls = _tool_calls(message.get("tool_calls"), f"{param}.tool_calls")
    return Turn(said, text, calls, "field" if reasoned else "")


def _tool_calls(value: Any, param: str) -> tuple[tuple[str, str], ...]:
    calls = []
    for j, call in enumerate(optional_list(value, param)):
        function = mapping(mapping(call, f"{param}[{j}]").get("function"), f"{param}[{j}].function")
        path = f"{param}[{j}].function"
        calls.append(
            tool_call(function.get("name"), function.get("arguments"), f"{path}.arguments", f"{path}.name")
        )
    return tuple(calls)


class _ChatStream(StreamedReply):
    """Each choice's content, refusal, reasoning and tool-call deltas, by choice index."""

    def __init__(self, reply_turns: ReplyTurns) -> None:
        super().__init__(reply_turns)
        self._choices: dict[int, Piece] = {}

    def _take(self, name: Any, data: Mapping[str, Any]) -> None:
        for j, choice in dicts(data.get("choices")):
            piece = self._choices.setdefault(index_or(choice.get("index"), j), Piece())
            delta = choice.get("delta")
            if not isinstance(delta, Mapping):
                continue
            append(piece.parts, delta.get("content"))
            append(piece.extra, delta.get("refusal"))
            for field in REASONING_FIELDS:
                append(piece.reasoning, delta.get(field))
            for k, fragment in dicts(delta.get("tool_calls")):
                _on_call_fragment(
                    piece.calls.setdefault(index_or(fragment.get("index"), k), Piece()), fragment
                )

    def reply(self) -> Mapping[str, Any] | None:
        if not self._choices:
            return None
        return {"choices": [_choice(i, piece) for i, piece in sorted(self._choices.items())]}


def _on_call_fragment(call: Piece, fragment: Mapping[str, Any]) -> None:
    """The name comes with the first fragment that has one; arguments arrive in pieces."""
    function = fragment.get("function")
    if not isinstance(function, Mapping):
        return
    if call.name is None and isinstance(function.get("name"), str):
        call.name = function["name"]
    append(call.parts, function.get("arguments"))


def _choice(index: int, piece: Piece) -> dict[str, Any]:
    calls = [
        {"function": {"name": call.name, "arguments": "".join(call.parts)}}
        for _, call in sorted(piece.calls.items())
    ]
    message = {
        "content": "".join(piece.parts),
        "refusal": "".join(piece.extra),
        "reasoning": "".join(piece.reasoning),
        "tool_calls": calls,
    }
    return {"index": index, "message": message}


__all__ = ["Chat"]
