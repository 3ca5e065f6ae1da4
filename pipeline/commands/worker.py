"""``tokentrail worker``: serve a model with capture on an OpenAI-compatible endpoint.

The worker publishes staged events to Kafka (``--bootstrap``) and writes rows to a
data plane it attaches to: the one whose addresses ``--dataplane-addresses`` names,
else the one ``TOKENTRAIL_DATAPLANE_*`` points at (see ``tokentrail dataplane``). It
serves until SIGTERM or SIGINT, then finishes in-flight requests, drains its staging
writer and shuts the engine down.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TYPE_CHECKING, Any

from aiokafka.errors import KafkaError

from pipeline.auth.arguments import add_auth_arguments, credentials_from_args, tls_from_args
from pipeline.kafka.config import ConfigError, add_kafka_arguments, config_from_args
from pipeline.process.flags import add_flags, from_flags
from pipeline.process.guard import guard_descendants
from pipeline.process.jsonlog import add_log_format_argument, configure_logging, vllm_logging
from pipeline.worker.settings import WorkerSettings
from stages.ports import DataPlaneError

if TYPE_CHECKING:
    from pipeline.worker.main import WorkerConfig

EXAMPLES = """\
examples:
  tokentrail make-tiny-model /tmp/tiny
  tokentrail dataplane --data-dir runs/exp1 &
  tokentrail worker --engine vllm --model /tmp/tiny --port 8100 \\
      --bootstrap 127.0.0.1:9092 --dataplane-addresses runs/exp1/dataplane.json
"""


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "worker",
        help="serve a model with token capture (OpenAI and Anthropic APIs, through vLLM)",
        description=(
            "Start an inference engine and serve vLLM's /v1/chat/completions, /v1/completions, "
            "/v1/responses and /v1/messages with capture: requests carrying ng_capture are "
            "recorded token-exact, staged to the data plane and announced on Kafka. Refit "
            "through /admin/* or vLLM's RL endpoints; metrics on /metrics."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(parser, WorkerSettings)
    add_kafka_arguments(parser, bootstrap_required=True)
    add_auth_arguments(parser, server=True, client=False)
    parser.add_argument("--json", action="store_true", help="print one JSON document once serving")
    add_log_format_argument(parser)
    parser.set_defaults(run=run)


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    """The worker's configuration from its flags; a ``ValueError`` (``FlagError`` among them)
    is a usage error."""
    settings = from_flags(WorkerSettings, args)
    return settings.worker_config(
        credentials_from_args(args), tls=tls_from_args(args), insecure_no_auth=args.insecure_no_auth
    )


def run(args: argparse.Namespace) -> int:
    # stdout carries only this verb's own report; vLLM logs to stderr in our format.
    configure_logging(args.log_format)
    vllm_logging(args.log_format, level="INFO")
    try:  # before the engine starts: a usage error, not a minute later
        config = worker_config(args)
    except ValueError as exc:
        print(f"tokentrail worker: {exc}", file=sys.stderr)
        return 2
    from pipeline.worker.foreground import serve_worker  # vLLM: imported once a worker starts

    guard_descendants()  # the engine's processes die with the worker
    try:
        kafka = config_from_args(args)
        asyncio.run(serve_worker(config, kafka, args.dataplane_addresses, as_json=args.json))
    except (ConfigError, DataPlaneError, KafkaError, ValueError, OSError) as exc:
        print(f"tokentrail worker: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
