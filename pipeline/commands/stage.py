"""``tokentrail stage ledger|finalizer``: run one stage as a long-lived consumer."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any

from pipeline.kafka.config import ConfigError, add_kafka_arguments, config_from_args
from pipeline.kafka.retention import add_retention_argument
from pipeline.process.flags import FlagError, add_flags, from_flags
from pipeline.process.heap import collect_per_batch
from pipeline.process.jsonlog import add_log_format_argument, configure_logging
from pipeline.stagehost.host import host_stage
from pipeline.stagehost.settings import StageHostSettings

log = logging.getLogger(__name__)

EXAMPLES = """\
examples:
  tokentrail stage ledger --bootstrap 127.0.0.1:9092
  tokentrail stage ledger --bootstrap kafka:9092 --seal-grace 30 --group ledger-prod
  tokentrail stage finalizer --bootstrap 127.0.0.1:9092 --data-dir .tokentrail
  tokentrail stage finalizer --bootstrap kafka:9092 --dataplane-mode ray --ray-address auto --mixed-versions reject
  tokentrail stage ledger --bootstrap kafka:9092 --metrics-port 9464 --metrics-host 0.0.0.0
  tokentrail stage ledger --bootstrap kafka:9092 --retention admission=5d --retention staged=5d

With --metrics-port the stage serves /metrics (Prometheus), /healthz (503 once the
consumer loop stalls for --stall-after seconds) and /readyz (200 once the group
assigned this member its partitions). With --ready-fd the stage writes one line to
that inherited file descriptor once its group first assigned it, and closes it: how
`tokentrail run` knows that its stage processes are serving.

The stage creates missing topics with --retention (DESIGN §7.6; an existing topic's
other retention is logged, not altered) and refuses one shorter than --max-open plus 1h.
Run several instances with the same --group to split partitions between them.
SIGTERM/SIGINT finish the in-flight batch, commit, and leave the group. A broker that
goes away is waited for: the stage reconnects (backing off up to 10 s), no restart needed.
"""


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "stage",
        help="run the ledger or finalizer stage as a long-lived consumer",
        description="Run one tokentrail stage as a member of its consumer group.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(parser, StageHostSettings)
    add_kafka_arguments(parser, bootstrap_required=True)
    add_retention_argument(parser)
    add_log_format_argument(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_format)
    collect_per_batch()
    try:
        settings = from_flags(StageHostSettings, args)
        asyncio.run(host_stage(settings, config_from_args(args)))
    except (ConfigError, FlagError) as exc:
        print(f"tokentrail stage: {exc}", file=sys.stderr)
        return 2
    except Exception:
        # Nothing was committed past the failed batch, so a restart replays it. Exit at
        # once: TransferQueue's client threads are not daemons and would keep a dead
        # stage's process alive, hiding the failure from whatever restarts it.
        log.exception("stage %s failed; exiting so that it is restarted", args.name)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 0
