"""``tokentrail drive``: play rollouts against a running cluster and archive their samples.

The operator's ``run``: the broker, data plane, stages and workers (or a gateway) are
already running; this plays the built-in environment (its generated tasks, or those of
``--tasks FILE``) against them with the same rollout flags as ``run``, waits for every
rollout's finalized event and for the stages' lag to reach 0, archives the accepted
samples to ``DATA_DIR/samples.jsonl``, and reports with the same JSON keys as
``run --json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pipeline.auth.arguments import add_auth_arguments
from pipeline.commands.run import ROLLOUT_GROUPS, run_config
from pipeline.kafka.config import ConfigError, add_kafka_arguments
from pipeline.kafka.retention import add_retention_argument
from pipeline.process.flags import add_flags, from_flags
from pipeline.process.jsonlog import add_log_format_argument, configure_logging
from pipeline.run.config import Attach, RunConfig
from pipeline.run.launch import execute_and_report

EXAMPLES = """\
examples:
  tokentrail drive --bootstrap 127.0.0.1:9092 --worker http://127.0.0.1:8000 \\
      --dataplane-addresses runs/exp1/dataplane.json --rollouts 12 --json
  tokentrail drive --bootstrap kafka:9092 --gateway http://gateway:8100 --model-name tiny-model \\
      --credentials-dir /etc/tokentrail
"""


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "drive",
        help="play rollouts against a running worker or gateway, wait for their samples, archive them",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = RunConfig()
    add_flags(parser, Attach)
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=defaults.data_dir,
        help="where this driver keeps its journal and samples.jsonl (default: %(default)s)",
    )
    add_flags(parser, RunConfig, groups=ROLLOUT_GROUPS)
    add_kafka_arguments(parser, bootstrap_required=True)
    add_retention_argument(parser)
    add_auth_arguments(parser, server=False, client=False)
    parser.add_argument("--json", action="store_true", help="print one JSON summary on stdout (run's keys)")
    add_log_format_argument(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_format)
    try:
        attach = from_flags(Attach, args, credentials_dir=args.credentials_dir)
        config = run_config(
            args, data_dir=args.data_dir, attach=attach, agent="sdk" if attach.gateway_url else "driver"
        )
    except (ConfigError, ValueError) as exc:
        print(f"tokentrail drive: {exc}", file=sys.stderr)
        return 2
    return execute_and_report(config, as_json=args.json)
