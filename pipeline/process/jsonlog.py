"""Log lines of every long-lived process: JSON objects (one per line) or plain text, on stderr.

``--log-format auto`` (the default) writes text on a terminal and JSON lines otherwise
(a pipe, a file, a container's log), so the worker, the stages, the gateway and ``run``
write the same lines into one log. vLLM's loggers, in this process and in the engine
processes it starts, go through the same formatter (``vllm_logging``). What libraries
write to stderr without logging (torch's C++ warnings, progress bars, a message an
engine process logs before its logging is configured) stays as it is.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

import orjson

LogFormat = Literal["auto", "json", "text"]
LOG_FORMATS: tuple[LogFormat, ...] = ("auto", "json", "text")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
QUIET = ("transformers", "transfer_queue", "ray", "aiokafka", "uvicorn", "httpx", "torch", "filelock")
"""Libraries whose INFO lines are noise in a service's log: warnings and worse only."""


class JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(line).decode()


def add_log_format_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="auto",
        help="stderr log lines: JSON objects or text; auto: text on a terminal, JSON otherwise (default: %(default)s)",
    )


def resolve(log_format: LogFormat) -> Literal["json", "text"]:
    if log_format == "auto":
        return "text" if sys.stderr.isatty() else "json"
    return log_format


def configure_logging(log_format: LogFormat = "json", level: int = logging.INFO) -> None:
    """One handler on the root logger, on stderr; safe to call more than once."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines() if resolve(log_format) == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.captureWarnings(True)  # Python warnings are log lines too
    logging.Formatter.converter = time.gmtime


def configured_format() -> Literal["json", "text"]:
    """The format this process logs in (``configure_logging``), for a child process that
    writes into the same log."""
    handlers = logging.getLogger().handlers
    return "json" if any(isinstance(handler.formatter, JsonLines) for handler in handlers) else "text"


def vllm_logging(log_format: LogFormat, level: str = "WARNING") -> None:
    """Make vLLM log in our format, in the engine processes too: vLLM reads a logging
    config file named by the environment in every process that imports it."""
    formatter = (
        {"()": f"{JsonLines.__module__}.JsonLines"}
        if resolve(log_format) == "json"
        else {"format": TEXT_FORMAT}
    )
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"tokentrail": formatter},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "tokentrail",
                "stream": "ext://sys.stderr",
            }
        },
        "loggers": {"vllm": {"handlers": ["stderr"], "level": level, "propagate": False}},
    }
    path = Path(tempfile.gettempdir()) / f"tokentrail-vllm-logging-{os.getpid()}.json"
    path.write_text(json.dumps(config))
    os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(path)
    if resolve(log_format) == "json":
        os.environ.setdefault("TQDM_DISABLE", "1")  # progress bars (weight loading) are no log lines
