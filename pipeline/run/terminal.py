"""On a terminal, the live view is the only thing that moves.

Every process of a run writes to the file descriptors 1 and 2 it inherits: the run's
own log lines, vLLM's engine core, and third parties' warnings (Triton, tcmalloc, NUMA
binding, torch). While a person watches, both descriptors point at a log file under
``DATA_DIR/logs/``, so all of that is kept in full and none of it scrolls through the
view; the live view, the summary, errors and the warnings a user can act on are drawn
on a copy of the terminal's descriptor. Piped or ``--json``, nothing of this applies.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.text import Text

from pipeline.kafka.embedded.broker import LOG_DIR

OWN_LOGGERS = ("pipeline", "stages", "topics")
"""Loggers whose warnings a user can act on; anyone's errors reach the screen too."""


@dataclass(frozen=True, slots=True)
class Screen:
    console: Console
    """Draws on the terminal itself."""
    log_path: Path
    """Where everything written to stdout and stderr goes meanwhile."""


class ScreenNotes(logging.Handler):
    """Errors from any logger, warnings from tokentrail's own: each message once, naming the log."""

    def __init__(self, screen: Screen) -> None:
        super().__init__(logging.WARNING)
        self.screen = screen
        self.shown: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < logging.ERROR and not record.name.startswith(OWN_LOGGERS):
            return
        message = record.getMessage()
        if message in self.shown:
            return
        self.shown.add(message)
        style = "bold red" if record.levelno >= logging.ERROR else "yellow"
        line = f"{record.levelname.lower()}: {message} (full log: {self.screen.log_path})"
        self.screen.console.print(Text(line, style=style))


@contextlib.contextmanager
def terminal_screen(data_dir: Path) -> Iterator[Screen]:
    """Send fds 1 and 2 (and so every child's) to a log file; yield a console on the terminal."""
    logs = data_dir / LOG_DIR  # beside the embedded broker's own log
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"run-{time.strftime('%Y%m%d-%H%M%S')}.log"
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    terminal = os.fdopen(os.dup(2), "w", buffering=1)
    with log_path.open("ab", buffering=0) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    screen = Screen(Console(file=terminal, stderr=False), log_path)
    notes = ScreenNotes(screen)
    logging.getLogger().addHandler(notes)
    try:
        yield screen
    finally:
        logging.getLogger().removeHandler(notes)
        sys.stdout.flush()
        sys.stderr.flush()
        for descriptor, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, descriptor)
            os.close(copy)
        terminal.close()


__all__ = ["Screen", "ScreenNotes", "terminal_screen"]
