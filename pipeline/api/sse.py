"""Server-sent events, read and written one way for every stream the runtime touches.

The worker adds commit coordinates to vLLM's stream, the gateway takes them out of the
worker's, and the gateway rebuilds a streamed reply into turns. All three read the same
wire format, so one reader serves them, and it reads what the format allows, not only what
vLLM happens to write: a ``data:`` field with or without its space, data over several lines
(joined by a newline), any line ending, comments and other fields kept as they were sent.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson

DONE = "[DONE]"
"""The OpenAI streams' last data, which is not JSON."""

_LINE_END = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True, slots=True)
class SseMessage:
    """One event: its ``event:`` name, its data, and its other lines as sent."""

    event: str | None
    data: str | None
    """The data lines joined by newlines; None when the message has no data field."""
    head: str
    """Every line that is not data (``event:``, ``id:``, comments), each ending in a newline."""

    def json(self) -> Any:
        """The data as JSON; None when there is none, it is ``[DONE]``, or it does not parse."""
        if self.data is None or self.data.strip() in ("", DONE):
            return None
        try:
            return orjson.loads(self.data)
        except orjson.JSONDecodeError:
            return None

    def with_data(self, value: Any) -> str:
        """The same message, its data replaced by ``value`` as JSON on one line."""
        return f"{self.head}data: {orjson.dumps(value).decode()}\n\n"


def messages(text: str) -> Iterator[SseMessage]:
    """Each message in ``text`` (one or more, separated by a blank line)."""
    for block in _LINE_END.sub("\n", text).split("\n\n"):
        if block.strip("\n"):
            yield _message(block)


def message(text: str) -> SseMessage:
    """The one message a stream chunk holds (the first, if it holds several)."""
    return next(messages(text), SseMessage(None, None, ""))


def _message(block: str) -> SseMessage:
    event: str | None = None
    data: list[str] = []
    head: list[str] = []
    for line in block.split("\n"):
        name, colon, value = line.partition(":")
        value = value.removeprefix(" ") if colon else ""
        if name == "data":
            data.append(value)
            continue
        if name == "event":
            event = value
        if line:
            head.append(line + "\n")
    return SseMessage(event, "\n".join(data) if data else None, "".join(head))


__all__ = ["DONE", "SseMessage", "message", "messages"]
