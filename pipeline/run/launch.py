"""A run started from the command line: its process's quiet libraries, and its report
(one JSON document on stdout, or on a terminal the live view and a table)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from typing import TYPE_CHECKING

from pipeline.process.jsonlog import LogFormat, vllm_logging
from pipeline.run.config import RunConfig
from pipeline.worker.reasoning import reasoning_parser_for
from pipeline.worker.tokenizer_mode import resolve_tokenizer_mode

if TYPE_CHECKING:
    from pipeline.run.terminal import Screen


def quiet_libraries(log_format: LogFormat) -> None:
    """vLLM logs through our lines (and only warnings); nothing it says goes to stdout."""
    vllm_logging(log_format)
    os.environ.setdefault("TQ_NUM_THREADS", str(min(8, os.cpu_count() or 1)))
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("vllm", "transformers", "transfer_queue", "ray", "aiokafka", "uvicorn", "httpx", "torch"):
        logging.getLogger(name).setLevel(logging.WARNING)


def check_servable(config: RunConfig) -> None:
    """Refuses, before anything starts, a model the worker could not serve as configured
    (a ``ValueError``: a usage error)."""
    model = config.model_dir
    if model is not None and not (model / "config.json").is_file():
        raise ValueError(f"{model} is not a model directory (no config.json)")
    reasoning_parser_for(config.reasoning_parser, "")
    if model is not None:  # the tiny model built otherwise has a template
        resolve_tokenizer_mode(model, config.tokenizer_mode)


def execute_and_report(config: RunConfig, *, as_json: bool) -> int:
    """Run, then report: the JSON document, or on a terminal the live view and a table."""
    from pipeline.run.terminal import terminal_screen

    config.data_dir.mkdir(parents=True, exist_ok=True)
    try:
        if as_json or not sys.stderr.isatty():
            return _execute(config, as_json=as_json, screen=None)
        with terminal_screen(config.data_dir) as screen:
            return _execute(config, as_json=False, screen=screen)
    except KeyboardInterrupt:  # before the run's own signal handling was in place
        return 130


def _execute(config: RunConfig, *, as_json: bool, screen: Screen | None) -> int:
    from rich.console import Console

    from pipeline.run.display import keep_banner, live_progress, summary_table
    from pipeline.run.main import execute
    from pipeline.run.report import RunProgress, RunSummary

    reported: list[RunSummary] = []

    def report(summary: RunSummary) -> None:
        reported.append(summary)
        if as_json:
            sys.stdout.write(json.dumps(summary.document(), sort_keys=True) + "\n")
            sys.stdout.flush()
        else:
            console = screen.console if screen is not None else Console()
            console.print(summary_table(summary))
            if screen is not None:
                console.print(f"full log: {screen.log_path}", style="dim", markup=False, highlight=False)
        if config.keep and summary.status == "completed":
            banner = keep_banner(summary)
            if screen is not None:
                screen.console.print(banner, markup=False, highlight=False)
            else:
                print(banner, file=sys.stderr, flush=True)

    progress = RunProgress()
    with live_progress(progress, screen.console) if screen is not None else contextlib.nullcontext():
        summary = execute(config, progress, on_complete=report)
    if not reported:
        report(summary)
    return summary.exit_code
