"""``tokentrail run``: the whole pipeline on one machine, end to end, then a clean stop.

Starts the embedded broker (or uses ``--bootstrap``), the embedded data plane, the
tiny model, one vLLM capture worker, the ledger and finalizer stages and the rollout
driver; waits until every rollout of the run is finalized and the stages' lag is 0;
archives the accepted samples to ``DATA_DIR/samples.jsonl``; stops everything.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pipeline.kafka.config import ConfigError, add_kafka_arguments, config_from_args
from pipeline.kafka.retention import add_retention_argument
from pipeline.process.flags import add_flags, from_flags
from pipeline.process.guard import guard_descendants
from pipeline.process.jsonlog import add_log_format_argument, configure_logging
from pipeline.run.config import ROLLOUTS, TIMING, RunConfig
from pipeline.run.launch import check_servable, execute_and_report, quiet_libraries

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


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_format)
    quiet_libraries(args.log_format)
    try:
        config = run_config(args)
        check_servable(config)
    except (ConfigError, ValueError) as exc:
        print(f"tokentrail run: {exc}", file=sys.stderr)
        return 2
    guard_descendants(config.data_dir, role="run")  # broker, engine, stages: none outlives this process
    return execute_and_report(config, as_json=args.json)
