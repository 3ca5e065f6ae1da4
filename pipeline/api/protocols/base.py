"""What every protocol object knows, so no caller branches on which API it speaks.

The gateway and the worker serve four HTTP APIs (OpenAI's Chat Completions, Completions
and Responses, Anthropic's Messages). Everything that differs between them lives behind
one `Protocol` object per API: the canonical turns of its requests and replies, how its
stream is rebuilt into a whole reply, where tokentrail's commit coordinates go in (and
come out of) its bodies, where its requests carry content parts, how vLLM's reply objects
are serialized for it, and the shape of its errors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any, ClassVar

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from pipeline.api import sse
from pipeline.api.errors import error_body
from pipeline.api.protocols.stream import StreamedReply
from pipeline.api.protocols.turns import Turn
from topics.records import CommitCoords
from topics.wire import COORDS_FIELD, Dialect

CoordsOf = Callable[[int], Awaitable[dict[str, Any] | None]]
"""A choice's commit coordinates as JSON, by choice index (None for an index past the call's)."""

STATUS_KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict",
    413: "request_too_large",
    429: "rate_limit_error",
}
"""The error ``type`` each status answers with, in both APIs' error shapes."""


class Protocol(ABC):
    """One HTTP API the runtime serves; `pipeline.api.protocols.PROTOCOLS` holds all four."""

    name: ClassVar[Dialect]
    path: ClassVar[str]
    """Where it is served, under a worker's root or a rollout's base URL."""
    turn_list: ClassVar[str | None]
    """The request field whose list holds the conversation (None: a prompt text)."""
    text_parts: ClassVar[frozenset[str]]
    """The content part types a text-only model takes in this API's requests."""
    stores_responses: ClassVar[bool] = False
    """A request may name an earlier reply instead of sending its history again."""

    def __repr__(self) -> str:
        return f"<protocol {self.name}>"

    # --- lineage ------------------------------------------------------------------

    @abstractmethod
    def history(self, body: Mapping[str, Any]) -> list[Turn] | str:
        """The request's history: canonical turns, or the prompt text compared by character."""

    @abstractmethod
    def reply_turns(self, reply: Mapping[str, Any]) -> dict[int, Turn]:
        """Each choice's reply (by choice index) as the assistant turn the agent will send back."""

    @abstractmethod
    def streamed_reply(self) -> StreamedReply:
        """An empty rebuild of one streamed reply, to feed the stream's events to."""

    def choice_count(self, body: Mapping[str, Any]) -> int:
        """How many choices one request asks for."""
        return 1

    # --- request options ----------------------------------------------------------

    @abstractmethod
    def content_part_types(self, body: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
        """Each content part's ``type`` in the request, with the path of that field."""

    # --- commit coordinates -------------------------------------------------------

    async def attach_coords(self, body: dict[str, Any], coords: CoordsOf, *, single: bool) -> dict[str, Any]:
        """A whole reply with its coords: at the top level when the call has a single choice."""
        if single:
            body[COORDS_FIELD] = await coords(0)
        return body

    @abstractmethod
    async def event_with_coords(self, event: str, coords: CoordsOf, *, single: bool) -> str:
        """One SSE message of the reply's stream; the one that ends a choice carries its coords."""

    def coords_in(self, value: Any) -> dict[int, CommitCoords]:
        """Each choice's coords in a reply or a streamed event (choice 0 at the top level)."""
        found: dict[int, CommitCoords] = {}
        if isinstance(value, dict):
            for holder in self._coords_holders(value):
                if isinstance(holder, dict) and isinstance(holder.get(COORDS_FIELD), dict) and 0 not in found:
                    found[0] = CommitCoords.model_validate(holder[COORDS_FIELD])
        return found

    def _coords_holders(self, value: dict[str, Any]) -> tuple[Any, ...]:
        """The objects that may carry a single choice's coords."""
        return (value,)

    # --- replies and errors -------------------------------------------------------

    def dump(self, result: BaseModel) -> dict[str, Any]:
        """A vLLM reply object as vLLM's own router for this API serializes it."""
        return result.model_dump(mode="json")

    def error(
        self, status: int, message: str, *, param: str | None = None, kind: str | None = None
    ) -> JSONResponse:
        """An error reply in this API's shape (OpenAI's, unless the API has its own)."""
        body = error_body(message, param=param, kind=kind or STATUS_KINDS.get(status, "server_error"))
        return JSONResponse(body, status_code=status)


async def coords_on_final_event(event: str, final: str, holder: str | None, coords: CoordsOf) -> str:
    """``event`` with the call's coords in its data (or its data's ``holder``) if it is the
    ``final`` event: the single-choice APIs put them on the event that ends the reply."""
    if final not in event:
        return event
    message = sse.message(event)
    data = message.json()
    if message.event != final or not isinstance(data, dict):
        return event
    target = data.get(holder) if holder is not None else data
    if isinstance(target, dict):
        target[COORDS_FIELD] = await coords(0)
    return message.with_data(data)


def part_types(items: list[Any], root: str, key: str) -> Iterator[tuple[str, Any]]:
    """The ``type`` of each content part of a list of messages or items (tool results' too)."""
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


__all__ = ["STATUS_KINDS", "CoordsOf", "Protocol", "coords_on_final_event", "part_types"]
