"""A streamed reply rebuilt into the whole reply's shape, one protocol's events at a time.

A streaming call must extend its history exactly as the same reply sent whole would, so
each protocol rebuilds its stream into the shape its whole reply has and reads that with
the same rules. Events are read with the one SSE codec; events that do not parse are
skipped: the agent's stream must never fail on lineage.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.api import sse
from pipeline.api.protocols.turns import MalformedHistory, Turn

ReplyTurns = Callable[[Mapping[str, Any]], dict[int, Turn]]


class StreamedReply(ABC):
    """Feed it each SSE message as the worker sent it; ask for the reply or its turns."""

    def __init__(self, reply_turns: ReplyTurns) -> None:
        self._reply_turns = reply_turns

    def feed(self, event: str) -> None:
        """Take one SSE message (``event:`` and ``data:`` lines); [DONE] and bad JSON skipped."""
        for message in sse.messages(event):
            data = message.json()
            if isinstance(data, dict):
                self._take(message.event or data.get("type"), data)

    @abstractmethod
    def _take(self, name: Any, data: Mapping[str, Any]) -> None:
        """One parsed event: its name (the ``event:`` line, else its data's ``type``) and data."""

    @abstractmethod
    def reply(self) -> Mapping[str, Any] | None:
        """The stream so far in the shape of the whole reply; None while it holds nothing."""

    def turns(self) -> dict[int, Turn]:
        """Each choice's reply so far; a reply that cannot be normalized has none."""
        try:
            reply = self.reply()
            return {} if reply is None else self._reply_turns(reply)
        except MalformedHistory:
            return {}


@dataclass(slots=True)
class Piece:
    """A growing part of a streamed reply: a choice's text, a tool call, or a content block."""

    kind: str = ""
    name: str | None = None
    parts: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)  # a chat choice's refusal
    reasoning: list[str] = field(default_factory=list)  # a chat choice's reasoning deltas
    initial: Any = None  # an Anthropic tool_use block's input at its start
    calls: dict[int, Piece] = field(default_factory=dict)  # a chat choice's tool calls


def append(parts: list[str], value: Any) -> None:
    """Keep a text fragment; anything else in its place is skipped."""
    if isinstance(value, str):
        parts.append(value)


def dicts(value: Any) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """The objects of a list with their positions; anything else is skipped."""
    if isinstance(value, list):
        for j, item in enumerate(value):
            if isinstance(item, Mapping):
                yield j, item


def index_or(value: Any, default: int) -> int:
    """An event's ``index`` field, or ``default`` when it is not an integer."""
    return value if isinstance(value, int) and not isinstance(value, bool) else default


__all__ = ["Piece", "ReplyTurns", "StreamedReply", "append", "dicts", "index_or"]
