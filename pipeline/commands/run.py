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
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from pipeline.kafka.config import ConfigError, add_kafka_arguments, config_from_args
from pipeline.kafka.embedded.broker import STORAGE_MODES
from pipeline.kafka.embedded.tansu import TANSU
from pipeline.kafka.retention import add_retention_argument
from pipeline.process.guard import guard_descendants
from pipeline.process.jsonlog import LogFormat, add_log_format_argument, configure_logging, vllm_logging
from pipeline.run.config import RunConfig, TrainerKind
from pipeline.worker.reasoning import reasoning_parser_for
from pipeline.worker.tokenizer_mode import TOKENIZER_MODES, resolve_tokenizer_mode
from stages.envs.arithmetic import RewardKind, read_tasks
from stages.trainer.settings import TRAINER_DTYPES
from stages.trainer.staleness import StaleMeasure

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
    defaults = RunConfig()
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=defaults.data_dir,
        help="broker store, tiny model, data-plane addresses and samples archive (default: %(default)s)",
    )
    parser.add_argument(
        "--model",
        type=Path,
        metavar="DIR",
        help="model directory to serve (default: the tiny model in DATA_DIR/tiny-model, built if missing)",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=defaults.reasoning_parser,
        metavar="NAME",
        help="the worker's vLLM reasoning parser; auto: the one that fits the model's template family "
        "(qwen3, deepseek_r1, openai_gptoss), if it reasons; none: off (default: %(default)s)",
    )
    parser.add_argument(
        "--tokenizer-mode",
        choices=TOKENIZER_MODES,
        default=defaults.tokenizer_mode,
        help="the worker's: mistral: chat through mistral_common, as vLLM serves Mistral models; auto: "
        "mistral where that is the model's only chat format, else its chat template (default: %(default)s)",
    )
    add_rollout_arguments(parser, defaults)
    ledger = parser.add_argument_group("ledger")
    ledger.add_argument(
        "--seal-grace",
        type=float,
        default=defaults.seal_grace_s,
        help="seconds a seal waits for calls in flight (default: %(default)s)",
    )
    ledger.add_argument(
        "--max-open",
        type=float,
        default=defaults.max_open_s,
        help="seconds before an unsealed rollout is closed (default: %(default)s)",
    )
    ledger.add_argument(
        "--fetch-wait-ms",
        type=int,
        default=defaults.fetch_wait_ms,
        help="how long the broker may hold the stages' fetches; on the embedded broker a longer "
        f"wait lets them read longer partitions (DESIGN §3) (default: the broker kind's, {TANSU.fetch_wait_ms} "
        "on the embedded broker)",
    )
    services = parser.add_argument_group("services")
    services.add_argument(
        "--broker-storage",
        choices=STORAGE_MODES,
        default=defaults.broker_storage,
        help="embedded broker storage: durable in DATA_DIR, or memory (default: %(default)s)",
    )
    services.add_argument(
        "--dataplane-mode",
        choices=("embedded", "ray"),
        default=defaults.dataplane_mode,
        help="embedded TransferQueue in this process, or TransferQueue on a Ray cluster (default: %(default)s)",
    )
    services.add_argument("--ray-address", help="Ray cluster address for --dataplane-mode ray (e.g. auto)")
    services.add_argument(
        "--stages",
        choices=("processes", "inline"),
        default=defaults.stages,
        help=(
            "the ledger and finalizer as `tokentrail stage` child processes, a core each, or as tasks "
            "in this process (default: %(default)s)"
        ),
    )
    add_kafka_arguments(parser)
    add_retention_argument(parser)
    parser.add_argument(
        "--agent",
        choices=("driver", "sdk"),
        default=defaults.agent,
        help=(
            "who plays the rollouts: the built-in driver (it builds admissions itself), or an "
            "agent using only the openai SDK through a gateway (default: %(default)s)"
        ),
    )
    training = parser.add_argument_group("training (the closed RL loop)")
    training.add_argument(
        "--train-steps",
        type=int,
        default=defaults.train_steps,
        metavar="N",
        help=(
            "play --rollouts rollouts, take one GRPO step on the model with their samples, load the new "
            "weights into the worker, N times; the JSON adds train_steps (default: %(default)s, no training)"
        ),
    )
    training.add_argument(
        "--trainer",
        choices=get_args(TrainerKind),
        default=defaults.trainer,
        help="who takes each step: the built-in GRPO step, or TRL's GRPOTrainer (default: %(default)s)",
    )
    training.add_argument(
        "--learning-rate",
        type=float,
        default=defaults.learning_rate,
        help="SGD step size (default: %(default)s)",
    )
    training.add_argument(
        "--max-staleness",
        type=int,
        default=defaults.max_staleness,
        metavar="VERSIONS",
        help=(
            "let generation run ahead of the trainer (either) by at most this many weight versions, "
            "pacing new rollouts (and drop samples further behind); default: play each step, then train"
        ),
    )
    training.add_argument(
        "--staleness-measure",
        choices=get_args(StaleMeasure),
        default=defaults.staleness_measure,
        help="a sample's version for staleness: its oldest token's, newest's or admission's (default: %(default)s)",
    )
    training.add_argument(
        "--trainer-delay-s",
        type=float,
        default=defaults.trainer_delay_s,
        metavar="SECONDS",
        help="a deliberately slow trainer: sleep this long before each built-in step (default: %(default)s)",
    )
    training.add_argument(
        "--trainer-dtype",
        choices=TRAINER_DTYPES,
        default=defaults.trainer_dtype,
        help="the trainer's weights (either trainer); bfloat16 against the fp32 engine shows a precision "
        "mismatch in each step's report (default: %(default)s)",
    )
    training.add_argument(
        "--shift-behaviour-temperature",
        type=float,
        default=None,
        metavar="T",
        help="benchmark only: the trainer is told every call sampled at temperature T, so the captured "
        "logprobs are of a wrong temperature to it (shows what the importance correction does)",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="after the run, keep broker, data plane, worker and stages serving until Ctrl-C",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON summary on stdout")
    add_log_format_argument(parser)
    parser.set_defaults(run=run)


def add_rollout_arguments(parser: argparse.ArgumentParser, defaults: RunConfig) -> None:
    """What to play and how long to wait: shared by ``run`` and ``drive``."""
    rollouts = parser.add_argument_group("rollouts")
    rollouts.add_argument(
        "--tasks",
        type=Path,
        metavar="FILE",
        help=(
            'play these tasks instead of generated ones: JSON lines {"task_id": ..., "expression": ...}, '
            "each played --group-size times (--rollouts is then their number times the group size)"
        ),
    )
    rollouts.add_argument(
        "--reward",
        choices=get_args(RewardKind),
        default=defaults.reward,
        help="how generated tasks are scored: their final answer, or the share of digits in the "
        "replies (dense: the learning curves' reward) (default: %(default)s)",
    )
    rollouts.add_argument(
        "--rollouts", type=int, default=defaults.rollouts, help="rollouts to play (default: %(default)s)"
    )
    rollouts.add_argument(
        "--group-size",
        type=int,
        default=defaults.group_size,
        help="GRPO group size: each task is played this many times (default: %(default)s)",
    )
    rollouts.add_argument(
        "--turns",
        type=int,
        default=defaults.turns,
        help="model calls per rollout, at most (default: %(default)s)",
    )
    rollouts.add_argument(
        "--concurrency",
        type=int,
        default=defaults.concurrency,
        help="rollouts in flight (default: %(default)s)",
    )
    rollouts.add_argument(
        "--max-tokens",
        type=int,
        default=defaults.max_tokens,
        help="tokens per model call (default: %(default)s)",
    )
    rollouts.add_argument(
        "--temperature",
        type=float,
        default=defaults.temperature,
        help="sampling temperature; 1.0 samples the policy itself, as on-policy RL does (default: %(default)s)",
    )
    for flag, kind, what in (
        ("--top-p", float, "nucleus sampling: keep the most likely tokens up to this mass"),
        ("--top-k", int, "keep the K most likely tokens"),
        ("--min-p", float, "keep tokens at least this fraction as likely as the most likely one"),
    ):
        rollouts.add_argument(
            flag,
            type=kind,
            default=None,
            help=f"{what}; recorded on every call and replayed by the trainers (default: not sent, so the "
            "model's generation_config.json, if any, decides)",
        )
    rollouts.add_argument(
        "--seed",
        type=int,
        default=defaults.seed,
        help="task, sampling and engine seed (default: %(default)s)",
    )
    timing = parser.add_argument_group("timing")
    timing.add_argument(
        "--timeout",
        type=float,
        default=defaults.finalize_timeout_s,
        help="seconds to wait for every rollout's FinalizedEvent after driving (default: %(default)s)",
    )
    timing.add_argument(
        "--lag-timeout",
        type=float,
        default=defaults.lag_timeout_s,
        help="seconds to wait for consumer lag 0 (default: %(default)s)",
    )


def rollout_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ``RunConfig`` fields of ``add_rollout_arguments``; a tasks file is read here
    (``TaskFileError``, a ``ValueError``, names its bad line)."""
    tasks = None
    if args.tasks is not None:
        with args.tasks.open() as lines:
            tasks = tuple(read_tasks(lines, str(args.tasks)))
    return {
        "rollouts": len(tasks) * args.group_size if tasks else args.rollouts,
        "tasks": tasks,
        "reward": args.reward,
        "group_size": args.group_size,
        "turns": args.turns,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "seed": args.seed,
        "finalize_timeout_s": args.timeout,
        "lag_timeout_s": args.lag_timeout,
    }


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
        config = RunConfig(
            data_dir=args.data_dir,
            model_dir=args.model,
            reasoning_parser=args.reasoning_parser,
            tokenizer_mode=args.tokenizer_mode,
            kafka=config_from_args(args),
            broker_storage=args.broker_storage,
            dataplane_mode=args.dataplane_mode,
            ray_address=args.ray_address,
            stages=args.stages,
            agent=args.agent,
            seal_grace_s=args.seal_grace,
            max_open_s=args.max_open,
            fetch_wait_ms=args.fetch_wait_ms,
            keep=args.keep,
            train_steps=args.train_steps,
            learning_rate=args.learning_rate,
            trainer=args.trainer,
            max_staleness=args.max_staleness,
            staleness_measure=args.staleness_measure,
            trainer_delay_s=args.trainer_delay_s,
            trainer_dtype=args.trainer_dtype,
            shift_behaviour_temperature=args.shift_behaviour_temperature,
            **rollout_settings(args),
        )
    except (ConfigError, ValueError, OSError) as exc:
        print(f"tokentrail run: {exc}", file=sys.stderr)
        return 2
    if args.model is not None and not (args.model / "config.json").is_file():
        print(f"tokentrail run: {args.model} is not a model directory (no config.json)", file=sys.stderr)
        return 2
    try:  # before anything starts: a usage error
        reasoning_parser_for(args.reasoning_parser, "")
        if args.model is not None:  # the tiny model built otherwise has a template
            resolve_tokenizer_mode(args.model, args.tokenizer_mode)
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
