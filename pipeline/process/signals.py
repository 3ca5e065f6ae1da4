"""SIGINT and SIGTERM as a request to stop, for a process that serves in the foreground.

A foreground server (the broker, the data plane) waits on an event instead of dying
where the signal lands, so that it stops its children and removes its files itself.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""What asks any long-lived tokentrail process to stop: threads wait on them here, event
loops add them as handlers (the run, the worker, a stage)."""


@contextmanager
def stop_event_on_signals() -> Iterator[threading.Event]:
    """An event that SIGINT or SIGTERM sets while inside; the previous handlers come back after."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def wait_until(stop: threading.Event) -> None:
    """Block until ``stop`` is set, waking often enough for signal handlers to run."""
    while not stop.wait(0.5):
        pass
