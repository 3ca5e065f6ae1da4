"""A stage process outlives its broker: it starts its stage again once the broker answers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from pipeline.kafka.errors import BROKER_UNREACHABLE
from pipeline.stagehost.metrics import Health

log = logging.getLogger(__name__)

RECONNECT_MIN_S = 0.5
RECONNECT_MAX_S = 10.0


async def serve_through_outages(
    serve: Callable[[], Awaitable[None]], name: str, health: Health, stop: asyncio.Event
) -> None:
    """``serve`` the stage; when the broker cannot be reached, start it again in this process
    once the broker answers (backing off), as a restart would: from the committed offsets,
    with state rebuilt by replay. Short outages never get here: the clients reconnect."""
    backoff = RECONNECT_MIN_S
    while not stop.is_set():
        started = asyncio.get_running_loop().time()
        try:
            await serve()
            return
        except BROKER_UNREACHABLE as exc:
            health.set_ready(False)
            if asyncio.get_running_loop().time() - started > RECONNECT_MAX_S:
                backoff = RECONNECT_MIN_S  # it had been serving: a new outage
            log.warning("stage %s: broker unreachable (%r); starting again in %.1fs", name, exc, backoff)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), backoff)
            backoff = min(backoff * 2, RECONNECT_MAX_S)
