"""Why a run stops early, and the background tasks whose failure stops it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)


class Stopped(Exception):
    """A stop was requested between start-up steps."""


class Shutdown:
    """Why the run stops early: a signal, or a part that failed. Set from handlers."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.signal: int | None = None
        self.failure: str | None = None

    def on_signal(self, signum: int) -> None:
        if self.event.is_set():
            log.warning("%s received again; already stopping", signal.Signals(signum).name)
            return
        self.signal = signum
        log.warning("%s received: stopping the run", signal.Signals(signum).name)
        self.event.set()

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            log.error("stopping the run: %s", reason)
        self.event.set()

    def check(self) -> None:
        """Raises ``Stopped`` once a stop was requested: start no further part."""
        if self.event.is_set():
            raise Stopped()


def background(
    stack: contextlib.AsyncExitStack, coro: Coroutine[Any, Any, None], name: str, shutdown: Shutdown
) -> asyncio.Task[None]:
    """A task that stops the run if it fails, cancelled (and awaited) when the stack unwinds to it."""
    task = asyncio.create_task(coro, name=name)

    def failed(done: asyncio.Task[None]) -> None:
        if not done.cancelled() and done.exception() is not None:
            shutdown.fail(f"{name}: {done.exception()!r}")

    task.add_done_callback(failed)

    async def cancel() -> None:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task

    stack.push_async_callback(cancel)
    return task
