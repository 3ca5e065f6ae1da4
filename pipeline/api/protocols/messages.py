"""Anthropic Messages (``/v1/messages``).

Turns: the top-level ``system`` (a string or text blocks) is a first ``"system"`` turn;
``messages[i]`` are ``user`` or ``assistant`` turns; ``tool_use`` blocks are tool calls
(name, canonical ``input``); ``thinking`` and ``redacted_thinking`` blocks are ignored;
each ``tool_result`` block of a user message is one ``"tool"`` turn (its content, a
string or text blocks), followed by the rest of that message's text, if it has text
blocks, as a ``"user"`` turn. A reply's content blocks are one assistant turn; a stream
is rebuilt block by block. The message carries the call's commit coordinates; streaming,
the ``message_delta`` event (the one that carries ``stop_reason``). Errors come in
Anthropic's shape, which has no ``param``: the message names the field.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from pipeline.api.protocols.base import STATUS_KINDS, CoordsOf, Protocol, coords_on_final_event, part_types
from pipeline.api.protocols.stream import Piece, ReplyTurns, StreamedReply, append, index_or
from pipeline.api.protocols.turns import (
    Turn,
    canonical,
    content_text,
    malformed,
    mapping,
    optional_str,
    required_list,
    role,
    tool_call,
)

_ROLES = {"user": "user", "assistant": "assistant"}
_IGNORED_BLOCKS = ("thinking", "redacted_thinking")
_BLOCK_DELTAS = {
    "text_delta": ("text", "text"),
    "input_json_delta": ("tool_use", "partial_json"),
}  # kind, field
_FINAL_EVENT = "message_delta"


class Messages(Protocol):
    name = "messages"
    path = "/v1/messages"
    turn_list = "messages"
    text_parts = frozenset({"text", "tool_use", "tool_result", "thinking", "redacted_thinking"})

    def history(self, body: Mapping[str, Any]) -> list[Turn]:
        turns: list[Turn] = []
        system = body.get("system")
        if system is not None:
            turns.append(Turn("system", content_text(system, "system")))
        for i, message in enumerate(required_list(body.get("messages"), "messages")):
            turns.extend(replace(turn, source=i) for turn in _message(message, f"messages[{i}]"))
        return canonical(turns)

    def reply_turns(self, reply: Mapping[str, Any]) -> dict[int, Turn]:
        return {0: canonical([_assistant(required_list(reply.get("content"), "content"), "content")])[0]}

    def streamed_reply(self) -> StreamedReply:
        return _MessagesStream(self.reply_turns)

    def content_part_types(self, body: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
        messages = body.get("messages")
        if isinstance(messages, list):
            yield from part_types(messages, "messages", "content")
        system = body.get("system")
        if isinstance(system, list):
            for j, part in enumerate(system):
                if isinstance(part, Mapping):
                    yield f"system[{j}].type", part.get("type")

    async def event_with_coords(self, event: str, coords: CoordsOf, *, single: bool) -> str:
        return await coords_on_final_event(event, _FINAL_EVENT, None, coords)

    def dump(self, result: BaseModel) -> dict[str, Any]:
        return result.model_dump(exclude_none=True)

    def error(
        self, status: int, message: str, *, param: str | None = None, kind: str | None = None
    ) -> JSONResponse:
        """Anthropic's shape; its ``type`` follows the status (the message names the field)."""
        body = {"type": "error", "error": {"type": STATUS_KINDS.get(status, "api_error"), "message": message}}
        return JSONResponse(body, status_code=status)


def _assistant(blocks: list[Any], param: str) -> Turn:
    texts: list[str] = []
    calls: list[tuple[str, str]] = []
    reasoned = False
    for j, block in enumerate(blocks):
        path = f"{param}[{j}]"
        block = mapping(block, path)
        kind = block.get("type")
        if kind == "text":
            texts.append(optional_str(block.get("text"), f"{path}.text"))
        elif kind == "tool_use":
            calls.append(tool_call(block.get("name"), block.get("input"), f"{path}.input", f"{path}.name"))
        elif kind in _IGNORED_BLOCKS:
            reasoned = True
        else:
            raise malformed(f"{path}.type", f"unsupported assistant block type {kind!r}")
    return Turn("assistant", "".join(texts), tuple(calls), "field" if reasoned else "")


def _user(blocks: list[Any], param: str) -> list[Turn]:
    """Tool results first, one turn each, then the message's own text as a user turn."""
    turns: list[Turn] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        path = f"{param}[{j}]"
        block = mapping(block, path)
        kind = block.get("type")
        if kind == "text":
            texts.append(optional_str(block.get("text"), f"{path}.text"))
        elif kind == "tool_result":
            turns.append(Turn("tool", content_text(block.get("content"), f"{path}.content")))
        else:
            raise malformed(f"{path}.type", f"unsupported user block type {kind!r}")
    if texts or not turns:
        turns.append(Turn("user", "".join(texts)))
    return turns


def _message(message: Any, param: str) -> list[Turn]:
    message = mapping(message, param)
    said = role(_ROLES, message.get("role"), f"{param}.role")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return [Turn(said, content or "")]
    blocks = required_list(content, f"{param}.content")
    if said == "assistant":
        return [_assistant(blocks, f"{param}.content")]
    return _user(blocks, f"{param}.content")


class _MessagesStream(StreamedReply):
    """Each content block, by its index: started whole, then grown by its deltas."""

    def __init__(self, reply_turns: ReplyTurns) -> None:
        super().__init__(reply_turns)
        self._blocks: dict[int, Piece] = {}

    def _take(self, name: Any, data: Mapping[str, Any]) -> None:
        index = index_or(data.get("index"), -1)
        block, delta = data.get("content_block"), data.get("delta")
        if index < 0:
            return
        if name == "content_block_start" and isinstance(block, Mapping):
            tool_name = block.get("name")
            piece = Piece(
                str(block.get("type")),
                tool_name if isinstance(tool_name, str) else None,
                initial=block.get("input"),
            )
            append(piece.parts, block.get("text") if piece.kind == "text" else None)
            self._blocks[index] = piece
        elif name == "content_block_delta" and isinstance(delta, Mapping):
            kind = delta.get("type")
            if isinstance(kind, str) and kind in _BLOCK_DELTAS:
                block_kind, key = _BLOCK_DELTAS[kind]
                append(self._blocks.setdefault(index, Piece(block_kind)).parts, delta.get(key))

    def reply(self) -> Mapping[str, Any] | None:
        if not self._blocks:
            return None
        return {"content": [_block(piece) for _, piece in sorted(self._blocks.items())]}


def _block(piece: Piece) -> dict[str, Any]:
    if piece.kind == "text":
        return {"type": "text", "text": "".join(piece.parts)}
    if piece.kind == "tool_use":  # no input deltas (or empty ones): the input the block started with
        arguments = "".join(piece.parts)
        return {
            "type": "tool_use",
            "name": piece.name,
            "input": arguments if arguments.strip() else piece.initial,
        }
    return {"type": piece.kind}


__all__ = ["Messages"]
