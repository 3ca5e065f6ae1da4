"""The inspector as a foreground process: read a run's log once (through a scratch copy,
or from a running deployment's brokers), then serve the read-only web app over it."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import uvicorn

from pipeline.auth.credentials import Credentials, Role
from pipeline.auth.transport import SERVER_KEEP_ALIVE_S, TlsFiles
from pipeline.inspect.app import create_inspect_app
from pipeline.inspect.source import RunSource
from pipeline.kafka.config import KafkaConfig


def serve_inspector(
    data_dir: Path,
    *,
    model_dir: Path | None,
    kafka: KafkaConfig | None,
    credentials: Credentials,
    tls: TlsFiles | None,
    host: str,
    port: int,
) -> None:
    """Serve until stopped; the URL to open goes to stderr. Raises ``NotADataDir`` (and,
    reading a deployment's log, ``ConfigError``) before anything is served."""
    with tempfile.TemporaryDirectory(prefix="tokentrail-inspect-") as scratch:
        source = RunSource.open(data_dir.resolve(), Path(scratch), model_dir, kafka)
        app = create_inspect_app(source, credentials, secure=tls is not None)
        scheme = "https" if tls else "http"
        login = "?token=<operator token>" if credentials.token(Role.OPERATOR) else ""
        print(f"tokentrail inspect: {scheme}://{host}:{port}/rollouts{login}", file=sys.stderr)
        uvicorn.run(
            app,
            host=host,
            port=port,
            log_level="warning",
            timeout_keep_alive=SERVER_KEEP_ALIVE_S,
            ssl_certfile=str(tls.certfile) if tls else None,
            ssl_keyfile=str(tls.keyfile) if tls else None,
        )
