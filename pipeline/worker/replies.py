"""Commit coordinates in vLLM's replies, where each protocol's client finds them.

- Chat and Completions: each choice carries its own ``ng_commit_coords``; with one
  choice the reply carries it at the top level too. Streaming: the chunk that carries a
  choice's ``finish_reason`` carries that choice's coords the same way.
- Responses: the response object carries them; streaming: the ``response`` object of
  the ``response.completed`` event.
- Messages (Anthropic): the message carries them; streaming: the ``message_delta``
  event (the one that carries ``stop_reason``).

Under ack policy ``staged`` the coords are those of a staged row, so the reply (or the
final event) waits for staging; the engine never does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pipeline.api import sse
from stages.capture.vllm.scope import CaptureScope
from topics.failures import WorkerFailure
from topics.wire import COORDS_FIELD, Dialect

CHOICE_DIALECTS = ("chat", "completions")


async def attach_coords(body: dict[str, Any], dialect: Dialect, scope: CaptureScope) -> dict[str, Any]:
    """A non-streaming reply with its choices' coords."""
    if dialect in CHOICE_DIALECTS:
        for choice in body.get("choices") or ():
            choice[COORDS_FIELD] = await _coords_json(scope, int(choice.get("index", 0)))
    if scope.n == 1:
        body[COORDS_FIELD] = await _coords_json(scope, 0)
    return body


async def stream_with_coords(
    events: AsyncIterator[str], dialect: Dialect, scope: CaptureScope, weight_version: int
) -> AsyncIterator[str]:
    """vLLM's SSE stream, each choice's final event carrying its coords.

    A stream that ends early (the client went away) fails every choice not yet captured
    with ``client_disconnected``: nothing is staged half-way.
    """
    outcome = WorkerFailure.CLIENT_DISCONNECTED
    try:
        async for event in events:
            yield await _with_coords(event, dialect, scope)
        outcome = WorkerFailure.NOT_SERVED
    finally:
        scope.abandon(outcome, weight_version)


async def _with_coords(event: str, dialect: Dialect, scope: CaptureScope) -> str:
    if dialect in CHOICE_DIALECTS:
        if '"finish_reason":"' not in event:
            return event
        message = sse.message(event)
        data = message.json()
        if not isinstance(data, dict):
            return event
        for choice in data.get("choices") or ():
            if choice.get("finish_reason") is not None:
                coords = await _coords_json(scope, int(choice.get("index", 0)))
                choice[COORDS_FIELD] = coords
                if scope.n == 1:
                    data[COORDS_FIELD] = coords
        return message.with_data(data)
    final = "response.completed" if dialect == "responses" else "message_delta"
    if final not in event:
        return event
    message = sse.message(event)
    data = message.json()
    if message.event != final or not isinstance(data, dict):
        return event
    target = data.get("response") if dialect == "responses" else data
    if isinstance(target, dict):
        target[COORDS_FIELD] = await _coords_json(scope, 0)
    return message.with_data(data)


async def _coords_json(scope: CaptureScope, index: int) -> dict[str, Any] | None:
    if not 0 <= index < scope.n:
        return None
    return (await scope.coords(index)).model_dump(mode="json")


__all__ = ["CHOICE_DIALECTS", "Dialect", "attach_coords", "stream_with_coords"]
