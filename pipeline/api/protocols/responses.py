"""OpenAI Responses (``/v1/responses``).

Turns: ``instructions`` is a first ``"system"`` turn; ``input`` as a string is one
``"user"`` turn; items of type ``"message"``, or with a ``role`` and no type, are turns
by role (``developer`` counts as ``system``); a ``function_call`` is an assistant tool
call (name, arguments); a ``function_call_output`` is a tool turn (its output's text);
``reasoning`` items are ignored; any other item type is refused. A reply's ``output``
items are one assistant turn. A stream is its final response object (the
``response.completed`` or ``response.incomplete`` event's), which also carries the
call's commit coordinates. A request may continue a stored response by id
(``previous_response_id``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import BaseModel

from pipeline.api.protocols.base import CoordsOf, Protocol, coords_on_final_event, part_types
from pipeline.api.protocols.stream import ReplyTurns, StreamedReply
from pipeline.api.protocols.turns import (
    CONVERSATION_ROLES,
    Turn,
    canonical,
    content_text,
    malformed,
    mapping,
    only_assistant,
    optional_str,
    required_list,
    role,
    tool_call,
)

_FINAL_EVENTS = ("response.completed", "response.incomplete")
_COMPLETED = "response.completed"
_RESPONSE = "response"


class Responses(Protocol):
    name = "responses"
    path = "/v1/responses"
    turn_list = "input"
    # reasoning_text and summary_text: a reply's own reasoning item, sent back as it came.
    text_parts = frozenset({"input_text", "output_text", "refusal", "text", "reasoning_text", "summary_text"})
    stores_responses = True

    def history(self, body: Mapping[str, Any]) -> list[Turn]:
        turns: list[Turn] = []
        instructions = body.get("instructions")
        if instructions is not None:
            turns.append(Turn("system", optional_str(instructions, "instructions")))
        given = body.get("input")
        if isinstance(given, str):
            turns.append(Turn("user", given))
        else:
            turns.extend(_items(required_list(given, "input"), "input"))
        return canonical(turns)

    def reply_turns(self, reply: Mapping[str, Any]) -> dict[int, Turn]:
        return {0: only_assistant(_items(required_list(reply.get("output"), "output"), "output"), "output")}

    def streamed_reply(self) -> StreamedReply:
        return _ResponsesStream(self.reply_turns)

    def content_part_types(self, body: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
        items = body.get("input")
        if isinstance(items, list):
            yield from part_types(items, "input", "content")

    async def event_with_coords(self, event: str, coords: CoordsOf, *, single: bool) -> str:
        return await coords_on_final_event(event, _COMPLETED, _RESPONSE, coords)

    def _coords_holders(self, value: dict[str, Any]) -> tuple[Any, ...]:
        return (value, value.get(_RESPONSE))

    def dump(self, result: BaseModel) -> dict[str, Any]:
        return result.model_dump(mode="json", by_alias=True)


def _items(items: list[Any], param: str) -> Iterator[Turn]:
    for i, item in enumerate(items):
        path = f"{param}[{i}]"
        item = mapping(item, path)
        kind = item.get("type")
        if kind == "message" or (kind is None and "role" in item):
            said = role(CONVERSATION_ROLES, item.get("role"), f"{path}.role")
            yield Turn(said, content_text(item.get("content"), f"{path}.content"), source=i)
        elif kind == "function_call":
            call = tool_call(item.get("name"), item.get("arguments"), f"{path}.arguments", f"{path}.name")
            yield Turn("assistant", "", (call,), source=i)
        elif kind == "function_call_output":
            yield Turn("tool", content_text(item.get("output"), f"{path}.output"), source=i)
        elif kind == "reasoning":
            yield Turn("assistant", "", reasoning="field", source=i)
        else:
            raise malformed(f"{path}.type", f"unsupported item type {kind!r}")


class _ResponsesStream(StreamedReply):
    """The final response object, once it arrived: it is the whole reply."""

    def __init__(self, reply_turns: ReplyTurns) -> None:
        super().__init__(reply_turns)
        self._response: Mapping[str, Any] | None = None

    def _take(self, name: Any, data: Mapping[str, Any]) -> None:
        response = data.get(_RESPONSE)
        if name in _FINAL_EVENTS and isinstance(response, Mapping):
            self._response = response

    def reply(self) -> Mapping[str, Any] | None:
        return self._response


__all__ = ["Responses"]
