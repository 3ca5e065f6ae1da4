"""What OpenAI's two choice APIs (Chat Completions, Completions) share: ``n`` choices per
request, each carrying its own commit coordinates.

Each choice carries its own ``ng_commit_coords``; with one choice the reply carries them
at the top level too. Streaming: the chunk that carries a choice's ``finish_reason``
carries that choice's coords the same way.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from pipeline.api import sse
from pipeline.api.protocols.base import CoordsOf, Protocol
from pipeline.api.protocols.turns import malformed, mapping, required_list
from topics.records import CommitCoords
from topics.wire import COORDS_FIELD


class ChoicesProtocol(Protocol):
    """An API whose replies are a list of choices."""

    def choice_count(self, body: Mapping[str, Any]) -> int:
        return int(body.get("n") or 1)

    async def attach_coords(self, body: dict[str, Any], coords: CoordsOf, *, single: bool) -> dict[str, Any]:
        for choice in body.get("choices") or ():
            choice[COORDS_FIELD] = await coords(int(choice.get("index", 0)))
        return await super().attach_coords(body, coords, single=single)

    async def event_with_coords(self, event: str, coords: CoordsOf, *, single: bool) -> str:
        if '"finish_reason":"' not in event:
            return event
        message = sse.message(event)
        data = message.json()
        if not isinstance(data, dict):
            return event
        for choice in data.get("choices") or ():
            if choice.get("finish_reason") is not None:
                found = await coords(int(choice.get("index", 0)))
                choice[COORDS_FIELD] = found
                if single:
                    data[COORDS_FIELD] = found
        return message.with_data(data)

    def coords_in(self, value: Any) -> dict[int, CommitCoords]:
        found: dict[int, CommitCoords] = {}
        if not isinstance(value, dict):
            return found
        for choice in value.get("choices") or ():
            if isinstance(choice, dict) and isinstance(choice.get(COORDS_FIELD), dict):
                found[int(choice.get("index", 0))] = CommitCoords.model_validate(choice[COORDS_FIELD])
        return {**super().coords_in(value), **found}


def choices(reply: Mapping[str, Any]) -> Iterator[tuple[int, Mapping[str, Any], str]]:
    """Each choice with its index (its ``index`` field, else its position) and its path."""
    for i, choice in enumerate(required_list(reply.get("choices"), "choices")):
        param = f"choices[{i}]"
        choice = mapping(choice, param)
        index = choice.get("index", i)
        if not isinstance(index, int) or isinstance(index, bool):
            raise malformed(f"{param}.index", "must be an integer")
        yield index, choice, param


__all__ = ["ChoicesProtocol", "choices"]
