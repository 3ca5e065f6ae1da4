"""``tokentrail gateway``: capture black-box agents that only know a base URL."""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import fields
from typing import TYPE_CHECKING, Any, get_args

from aiokafka.errors import KafkaError

from pipeline.auth.arguments import add_auth_arguments, credentials_from_args, tls_from_args
from pipeline.gateway.pacing import optional_pacing
from pipeline.gateway.quotas import Quotas
from pipeline.kafka.config import ConfigError, KafkaConfig, add_kafka_arguments, config_from_args
from pipeline.process.jsonlog import add_log_format_argument, configure_logging
from pipeline.worker import add_body_limit_argument
from stages.ledger.stage import LedgerConfig
from topics.records import SamplePolicy

if TYPE_CHECKING:
    from pipeline.gateway.main import GatewayConfig

EXAMPLES = """example:
  tokentrail gateway --workers http://127.0.0.1:8000 --bootstrap 127.0.0.1:9092 --port 8100 \
      --credentials-dir /etc/tokentrail
  # environment: curl -H "Authorization: Bearer $(cat /etc/tokentrail/environment.token)" \
  #   -X POST http://127.0.0.1:8100/rollouts   -> base_url, anthropic_base_url, api_key
  # agent (OpenAI or Anthropic SDK): base_url and api_key from that answer, nothing else
  # environment: POST http://127.0.0.1:8100/rollouts/ROLLOUT/seal -d '{"reward": 1.0}'
"""


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "gateway",
        help="capture unmodified agents: a rollout session per base URL, in front of workers",
        description=(
            "Serve rollout sessions in front of one or more capture workers. An agent pointed at "
            "a session's base URL is captured without changes: the gateway finds each call's "
            "parent from the history it sends, publishes admissions and seals, and strips "
            "tokentrail's fields from every reply."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--workers", required=True, metavar="URL[,URL...]", help="capture workers to forward calls to"
    )
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    parser.add_argument(
        "--port", type=int, default=8100, help="listen port; 0 picks a free one (default: %(default)s)"
    )
    parser.add_argument(
        "--session-ttl",
        type=float,
        default=600.0,
        metavar="S",
        help="a session idle this long is sealed failed 'abandoned' (default: %(default)s)",
    )
    parser.add_argument(
        "--sample-policy",
        choices=get_args(SamplePolicy),
        default="terminal",
        help=(
            "which chains of a rollout become samples when its seal does not say: the terminal chain, "
            "every root-to-leaf chain (leaves), or each root's longest chain (chains, for agents that "
            "rewrite their history) (default: %(default)s)"
        ),
    )
    recovery = parser.add_argument_group(
        "recovery and replicas (a restart reads the log from the gateway's bookmark, not its beginning)"
    )
    recovery.add_argument(
        "--replica",
        metavar="NAME",
        help="this replica's name, one of several behind one address routing by rollout id: a rollout "
        "it does not hold is taken over from the log when called (default: the only gateway)",
    )
    recovery.add_argument(
        "--max-open",
        type=float,
        default=LedgerConfig().max_open_s,
        metavar="S",
        help="the ledger's --max-open: older unsealed rollouts are neither rebuilt nor hold the "
        "bookmark back (default: %(default)s)",
    )
    recovery.add_argument(
        "--checkpoint-every",
        type=float,
        default=30.0,
        metavar="S",
        help="how often the bookmark is committed (default: %(default)s)",
    )
    add_body_limit_argument(parser)
    quotas = parser.add_argument_group("per-rollout quotas (over one: 429 naming it)")
    for spec in fields(Quotas):
        flag = "--" + spec.name.replace("_", "-")
        quotas.add_argument(flag, type=int, default=spec.default, metavar="N", help="(default: %(default)s)")
    quotas.add_argument(
        "--worker-slots",
        type=int,
        metavar="N",
        help="calls each worker runs at once, shared fairly among the sessions that want them (a "
        "session over its share waits, never fails); 0 turns fair shares off (default: learned per "
        "worker from its measured speed, the batch its engine still serves fast; a session's "
        "first call never waits)",
    )
    pacing = parser.add_argument_group(
        "pacing (POST /rollouts answers 429 with Retry-After while the trainer is too far behind)"
    )
    pacing.add_argument(
        "--max-staleness",
        type=int,
        metavar="VERSIONS",
        help="admit at most this many weight versions ahead of what the workers serve (default: no pacing)",
    )
    pacing.add_argument(
        "--rollouts-per-step",
        type=int,
        metavar="N",
        help="rollouts the trainer takes per step (its batch); required with --max-staleness",
    )
    add_auth_arguments(parser, server=True, client=True)
    add_kafka_arguments(parser, bootstrap_required=True)
    parser.add_argument("--json", action="store_true", help="print one JSON document once serving")
    add_log_format_argument(parser)
    parser.set_defaults(run=run)


def gateway_config(args: argparse.Namespace, kafka: KafkaConfig) -> GatewayConfig:
    from pipeline.gateway.main import GatewayConfig

    return GatewayConfig(
        workers=tuple(url.strip() for url in args.workers.split(",") if url.strip()),
        kafka=kafka,
        host=args.host,
        port=args.port,
        session_ttl_s=args.session_ttl,
        replica=args.replica,
        max_open_s=args.max_open,
        checkpoint_every_s=args.checkpoint_every,
        sample_policy=args.sample_policy,
        max_body_bytes=args.max_body_bytes,
        credentials=credentials_from_args(args),
        quotas=Quotas(**{spec.name: getattr(args, spec.name) for spec in fields(Quotas)}),
        worker_slots=args.worker_slots,
        pacing=optional_pacing(args.max_staleness, args.rollouts_per_step),
        insecure_no_auth=args.insecure_no_auth,
        tls=tls_from_args(args),
        ssl_cafile=args.http_ssl_cafile,
    )


def run(args: argparse.Namespace) -> int:
    from pipeline.gateway.foreground import serve_gateway

    configure_logging(args.log_format)
    try:
        kafka = config_from_args(args)
        asyncio.run(serve_gateway(gateway_config(args, kafka), kafka, as_json=args.json))
    except (ConfigError, KafkaError, ValueError, OSError) as exc:
        print(f"tokentrail gateway: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
