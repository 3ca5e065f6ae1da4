"""``tokentrail gateway``: capture black-box agents that only know a base URL."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from aiokafka.errors import KafkaError

from pipeline.auth.arguments import add_auth_arguments, credentials_from_args, tls_from_args
from pipeline.gateway.settings import GatewaySettings
from pipeline.kafka.config import ConfigError, add_kafka_arguments, config_from_args
from pipeline.process.flags import FlagError, add_flags, from_flags
from pipeline.process.jsonlog import add_log_format_argument, configure_logging

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
    add_flags(parser, GatewaySettings)
    add_auth_arguments(parser, server=True, client=True)
    add_kafka_arguments(parser, bootstrap_required=True)
    parser.add_argument("--json", action="store_true", help="print one JSON document once serving")
    add_log_format_argument(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pipeline.gateway.foreground import serve_gateway

    configure_logging(args.log_format)
    try:
        settings = from_flags(GatewaySettings, args)
    except FlagError as exc:
        print(f"tokentrail gateway: {exc}", file=sys.stderr)
        return 2
    try:
        kafka = config_from_args(args)
        config = settings.gateway_config(
            kafka,
            credentials_from_args(args),
            tls=tls_from_args(args),
            ssl_cafile=args.http_ssl_cafile,
            insecure_no_auth=args.insecure_no_auth,
        )
        asyncio.run(serve_gateway(config, kafka, as_json=args.json))
    except (ConfigError, KafkaError, ValueError, OSError) as exc:
        print(f"tokentrail gateway: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
