"""Responses ``previous_response_id``: the gateway keeps the conversation the worker does not.

The worker stores no responses (it refuses ``previous_response_id``), so the gateway
remembers, per Responses call of a session, the input it forwarded and the output the
agent got. A request naming a previous response is expanded to that input, that output,
then its own input, and forwarded without the id: the expanded history continues the
named call, so lineage finds it as the parent like any other continuation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.api.errors import InvalidRequest

PREVIOUS = "previous_response_id"


class ResponseLog:
    """Each Responses call of one session: the input the agent sent, the output it got, and
    the response it continued, so a conversation costs its items once, not once per turn."""

    def __init__(self) -> None:
        self._calls: dict[str, tuple[str | None, list[Any]]] = {}

    def expand(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` with the named previous response's conversation in front of its input."""
        previous = body.get(PREVIOUS)
        if previous is None:
            return body
        if not isinstance(previous, str) or previous not in self._calls:
            raise InvalidRequest(PREVIOUS, f"{PREVIOUS}: {previous!r} is not a response of this rollout")
        expanded = {k: v for k, v in body.items() if k != PREVIOUS}
        expanded["input"] = [*self._conversation(previous), *_items(body.get("input"))]
        return expanded

    def remember(self, sent: Mapping[str, Any], reply: Mapping[str, Any]) -> None:
        """After a reply: its id names what the agent sent followed by the output it got."""
        response_id, output = reply.get("id"), reply.get("output")
        if isinstance(response_id, str) and isinstance(output, list):
            previous = sent.get(PREVIOUS)
            self._calls[response_id] = (
                previous if isinstance(previous, str) else None,
                [*_items(sent.get("input")), *output],
            )

    def _conversation(self, response_id: str) -> list[Any]:
        chain: list[list[Any]] = []
        current: str | None = response_id
        while current is not None and current in self._calls:
            current, items = self._calls[current]
            chain.append(items)
        return [item for items in reversed(chain) for item in items]


def _items(value: Any) -> list[Any]:
    """Responses input as a list of items (a string is one user message)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return list(value) if isinstance(value, list) else [value]


__all__ = ["PREVIOUS", "ResponseLog"]
