"""The command-line flags of credentials and TLS, shared by every verb that serves or calls HTTP.

The HTTP TLS flags are ``--http-ssl-*``: ``--ssl-*`` already configure the Kafka clients."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.auth.credentials import AGENT_KEY_FILE, ROLE_FILES, ROLE_VARIABLES, Credentials
from pipeline.auth.transport import TlsFiles

_FILES = ", ".join([*ROLE_FILES.values(), AGENT_KEY_FILE])
_VARIABLES = ", ".join(ROLE_VARIABLES.values())


def add_auth_arguments(parser: argparse.ArgumentParser, *, server: bool, client: bool) -> None:
    group = parser.add_argument_group("credentials and TLS (DESIGN §15)")
    group.add_argument(
        "--credentials-dir",
        type=Path,
        metavar="DIR",
        help=f"role secrets, one file each ({_FILES}); {_VARIABLES} override them. Never on argv.",
    )
    if server:
        group.add_argument(
            "--insecure-no-auth",
            action="store_true",
            help="allow a non-loopback --host without credentials (anyone who reaches it is trusted)",
        )
        group.add_argument(
            "--http-ssl-certfile", type=Path, metavar="PEM", help="serve HTTPS with this certificate"
        )
        group.add_argument(
            "--http-ssl-keyfile", type=Path, metavar="PEM", help="the certificate's private key"
        )
    if client:
        group.add_argument(
            "--http-ssl-cafile",
            type=Path,
            metavar="PEM",
            help="verify the HTTPS servers it calls against this CA",
        )


def credentials_from_args(args: argparse.Namespace) -> Credentials:
    return Credentials.load(args.credentials_dir)


def tls_from_args(args: argparse.Namespace) -> TlsFiles | None:
    certfile, keyfile = args.http_ssl_certfile, args.http_ssl_keyfile
    if certfile is None and keyfile is None:
        return None
    if certfile is None or keyfile is None:
        raise ValueError("--http-ssl-certfile, --http-ssl-keyfile: give both or neither")
    for flag, path in (("--http-ssl-certfile", certfile), ("--http-ssl-keyfile", keyfile)):
        if not path.is_file():
            raise ValueError(f"{flag}: {path} is not a file")
    return TlsFiles(certfile, keyfile)


__all__ = ["add_auth_arguments", "credentials_from_args", "tls_from_args"]
