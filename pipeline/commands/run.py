"""``tokentrail run``: the whole pipeline on one machine, end to end, then a clean stop.

Starts the embedded broker (or uses ``--bootstrap``), the embedded data plane, the
tiny model, one vLLM capture worker, the ledger and finalizer stages and the rollout
driver; waits until every rollout of the run is finalized and the stages' lag is 0;
archives the accepted samples to ``DATA_DIR/samples.jsonl``; stops everything.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from pipeline.kafka.config import ConfigError, add_kafka_arguments, config_from_args
from pipeline.kafka.retention import add_retention_argument
from pipeline.process.flags import add_flags, from_flags
from pipeline.process.guard import guard_descendants
from pipeline.process.jsonlog import LogFormat, add_log_format_argument, configure_logging, vllm_logging
from pipeline.run.config import ROLLOUTS, TIMING, RunConfig
from pipeline.worker.reasoning import reasoning_parser_for
from pipeline.worker.tokenizer_mode import resolve_tokenizer_mode

if TYPE_CHECKING:
    from pipeline.run.terminal import Screen

EXAMPLES = """\
examples:
  tokentrail run                                   # 8 rollouts, groups of 4, 3 turns, in .tokentrail
  tokentrail run --json --data-dir /tmp/tt          # one JSON summary on stdout
  tokentrail run --rollouts 32 --group-size 8 --turns 4 --concurrency 8
  tokentrail run --keep                            # stay up afterwards for replay / lag / export
  tokentrail run --model ./my-model --temperature 0.7 --max-tokens 128
  tokentrail run --bootstrap kafka:9092 --security-protocol SASL_SSL \\
      --sasl-mechanism SCRAM-SHA-512 --sasl-username tt --ssl-cafile ca.pem

Running again on the same --data-dir continues the same durable log: the stages
resume from their committed offsets and the new run finalizes only its own rollouts.
Exit status: 0 when every rollout is finalized and the lag is 0; 130 on Ctrl-C,
143 on SIGTERM; 1 on a timeout or a failure; 2 on bad arguments.
"""


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "run",
        help="run the whole pipeline end to end on this machine (what `make run` does)",
        description=(
            "Start the embedded broker, data plane, tiny model, a vLLM capture worker, the ledger\n"
            "and finalizer stages and a rollout driver playing an arithmetic tool-use environment;\n"
            "wait until every rollout of this run is finalized and consumer lag is 0; archive the\n"
            "accepted samples to DATA_DIR/samples.jsonl (TransferQueue keeps them in memory only);\n"
            "then stop everything cleanly."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(parser, RunConfig)
    add_kafka_arguments(parser)
    add_retention_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON summary on stdout")
    add_log_format_argument(parser)
    parser.set_defaults(run=run)


ROLLOUT_GROUPS = (ROLLOUTS, TIMING)
"""The flags of what to play and how long to wait: shared by ``run`` and ``drive``."""


def run_config(args: argparse.Namespace, **given: Any) -> RunConfig:
    """The run's settings from its flags (``given``: those that are no flags). A tasks file
    decides the number of rollouts: each of its tasks is played group-size times."""
    if args.tasks:
        given["rollouts"] = len(args.tasks) * args.group_size
    return from_flags(RunConfig, args, kafka=config_from_args(args), **given)


def _quiet_libraries(log_format: LogFormat) -> None:
    """vLLM logs through our lines (and only warnings); nothing it says goes to stdout."""
    vllm_logging(log_format)
    os.environ.setdefault("TQ_NUM_THREADS", str(min(8, os.cpu_count() or 1)))
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("vllm", "transformers", "transfer_queue", "ray", "aiokafka", "uvicorn", "httpx", "torch"):
        logging.getLogger(name).setLevel(logging.WARNING)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_format)
    _quiet_libraries(args.log_format)
    try:
        config = run_config(args)
    except (ConfigError, ValueError) as exc:
        print(f"tokentrail run: {exc}", file=sys.stderr)
        return 2
    model = config.model_dir
    if model is not None and not (model / "config.json").is_file():
        print(f"tokentrail run: {model} is not a model directory (no config.json)", file=sys.stderr)
        return 2
    try:  # before anything starts: a usage error
        reasoning_parser_for(config.reasoning_parser, "")
        if model is not None:  # the tiny model built otherwise has a template
            resolve_tokenizer_mode(model, config.tokenizer_mode)
    except ValueError as exc:
        print(f"tokentrail run: {exc}", file=sys.stderr)
        return 2
    guard_descendants(config.data_dir, role="run")  # broker, engine, stages: none outlives this process
    return execute_and_report(config, as_json=args.json)


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
