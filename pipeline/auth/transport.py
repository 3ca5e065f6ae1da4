"""Where a server may listen, and TLS for servers and their clients.

A server bound beyond loopback with no role credentials would trust anyone who can
reach it, so it is refused unless the operator says ``--insecure-no-auth`` (and a
warning is logged). TLS is uvicorn's (``--http-ssl-certfile``/``--http-ssl-keyfile``); clients
verify against ``--http-ssl-cafile`` when given, else the system's roots.
"""

from __future__ import annotations

import ipaddress
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path

from pipeline.auth.credentials import Credentials

log = logging.getLogger(__name__)

SERVER_KEEP_ALIVE_S = 75
"""How long a server keeps an idle connection open. It must outlast every client's own idle
expiry (httpx, and so the openai SDK, drop theirs after 5 s): were the server the one to close
first, a request sent on the connection as it closed would fail with a read error, which no
client retries (uvicorn's own default is that same 5 s)."""


class InsecureBind(ValueError):
    """A non-loopback listen address without credentials."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def check_bind(host: str, credentials: Credentials, *, insecure_no_auth: bool, what: str) -> None:
    """Refuse a listen address that anyone could reach without a credential."""
    if credentials.enabled or is_loopback(host):
        return
    if not insecure_no_auth:
        raise InsecureBind(
            f"--host {host}: the {what} would accept anyone beyond loopback; give it credentials "
            "(--credentials-dir or TOKENTRAIL_*_TOKEN) or pass --insecure-no-auth"
        )
    log.warning(
        "the %s listens on %s without credentials (--insecure-no-auth): anyone who reaches it is trusted",
        what,
        host,
    )


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """A server's certificate chain and key (PEM)."""

    certfile: Path
    keyfile: Path


def client_verify(cafile: Path | None) -> ssl.SSLContext | bool:
    """What an httpx client verifies servers with: the CA file, else the system's roots."""
    return True if cafile is None else ssl.create_default_context(cafile=str(cafile))


__all__ = ["InsecureBind", "TlsFiles", "check_bind", "client_verify", "is_loopback"]
