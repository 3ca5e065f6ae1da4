"""``tokentrail inspect DATA_DIR``: a read-only web view of a finished run, or of a running
deployment's log with ``--bootstrap`` (DESIGN §16)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pipeline.auth.arguments import add_auth_arguments, credentials_from_args, tls_from_args
from pipeline.auth.credentials import CREDENTIALS_DIR, Credentials
from pipeline.auth.transport import InsecureBind, check_bind
from pipeline.inspect.serve import serve_inspector
from pipeline.inspect.settings import InspectSettings
from pipeline.inspect.source import NotADataDir
from pipeline.kafka.config import ConfigError, add_kafka_arguments, config_from_args
from pipeline.process.flags import add_flags, from_flags
from pipeline.process.guard import guard_descendants
from pipeline.process.jsonlog import add_log_format_argument, configure_logging

EXAMPLES = """\
examples:
  tokentrail inspect .tokentrail
  tokentrail inspect /data/tt --host 0.0.0.0 --port 8300 --credentials-dir /data/tt/credentials
  tokentrail inspect /data/archive --bootstrap kafka:9092 --credentials-dir /etc/tokentrail

With the credentials a run minted (DATA_DIR/credentials/), open it once with the
operator token, which becomes a cookie:
  http://127.0.0.1:8200/rollouts?token=$(cat .tokentrail/credentials/operator.token)
"""


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "inspect",
        help="browse a finished run's rollouts, call trees and sample tokens in a web browser",
        description=(
            "Serve a read-only web app over a run's data directory: the ledger rebuilt from a\n"
            "copy of its event log, and the sample archive. Nothing is written to the pipeline."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(parser, InspectSettings)
    add_auth_arguments(parser, server=True, client=False)
    add_kafka_arguments(parser)  # --bootstrap: a running deployment's log, read once at start
    add_log_format_argument(parser)
    parser.set_defaults(run=run)


def credentials_for(args: argparse.Namespace, data_dir: Path) -> Credentials:
    """``--credentials-dir``, else the ones the run minted in the data directory."""
    if args.credentials_dir is None and (data_dir / CREDENTIALS_DIR).is_dir():
        args.credentials_dir = data_dir / CREDENTIALS_DIR
    return credentials_from_args(args)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_format)
    settings = from_flags(InspectSettings, args)
    try:
        credentials = credentials_for(args, settings.data_dir)
        check_bind(settings.host, credentials, insecure_no_auth=args.insecure_no_auth, what="inspector")
        tls = tls_from_args(args)
    except (InsecureBind, ValueError) as exc:
        print(f"tokentrail inspect: {exc}", file=sys.stderr)
        return 2
    guard_descendants(role="inspect")  # the broker it reads the log's copy through dies with it
    try:
        serve_inspector(
            settings.data_dir,
            model_dir=settings.model_dir,
            kafka=config_from_args(args) if args.bootstrap else None,
            credentials=credentials,
            tls=tls,
            host=settings.host,
            port=settings.port,
        )
    except (NotADataDir, ConfigError) as exc:
        print(f"tokentrail inspect: {exc}", file=sys.stderr)
        return 2
    return 0
