"""Commit coordinates in vLLM's replies, where each protocol's client finds them.

Each protocol says where (``pipeline.api.protocols``): on each choice and, with one
choice, at the top level (Chat, Completions); on the response or message object
(Responses, Messages); streaming, on the event that ends each choice.

Under ack policy ``staged`` the coords are those of a staged row, so the reply (or the
final event) waits for staging; the engine never does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from pipeline.api.protocols import Protocol
from stages.capture.vllm.scope import CaptureScope
from topics.failures import WorkerFailure


async def attach_coords(body: dict[str, Any], protocol: Protocol, scope: CaptureScope) -> dict[str, Any]:
    """A non-streaming reply with its choices' coords."""
    return await protocol.attach_coords(body, partial(_coords_json, scope), single=scope.n == 1)


async def stream_with_coords(
    events: AsyncIterator[str], protocol: Protocol, scope: CaptureScope, weight_version: int
) -> AsyncIterator[str]:
    """vLLM's SSE stream, each choice's final event carrying its coords.

    A stream that ends early (the client went away) fails every choice not yet captured
    with ``client_disconnected``: nothing is staged half-way.
    """
    outcome = WorkerFailure.CLIENT_DISCONNECTED
    coords = partial(_coords_json, scope)
    try:
        async for event in events:
            yield await protocol.event_with_coords(event, coords, single=scope.n == 1)
        outcome = WorkerFailure.NOT_SERVED
    finally:
        scope.abandon(outcome, weight_version)


async def _coords_json(scope: CaptureScope, index: int) -> dict[str, Any] | None:
    if not 0 <= index < scope.n:
        return None
    return (await scope.coords(index)).model_dump(mode="json")


__all__ = ["attach_coords", "stream_with_coords"]
