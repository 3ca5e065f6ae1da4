"""HTTPS on the servers' own uvicorn, with a certificate authority the test makes."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trustme

from pipeline.auth.credentials import Credentials
from pipeline.auth.transport import TlsFiles, client_verify
from pipeline.gateway.app import create_gateway_app
from pipeline.gateway.calls import Forwarder
from pipeline.gateway.sessions import Sessions
from pipeline.gateway.upstream import Workers
from pipeline.worker.main import WorkerServer
from stages.client import RolloutClient
from stages.memory import RecordingSink


@pytest.mark.anyio
async def test_the_gateway_serves_https_that_a_client_verifies_against_the_ca(tmp_path: Path) -> None:
    authority = trustme.CA()
    issued = authority.issue_cert("127.0.0.1")
    certfile, keyfile, cafile = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    issued.cert_chain_pems[0].write_to_path(str(certfile))
    issued.private_key_pem.write_to_path(str(keyfile))
    authority.cert_pem.write_to_path(str(cafile))

    client = RolloutClient(RecordingSink())
    async with httpx.AsyncClient() as upstream:
        sessions = Sessions(client, ttl_s=60)
        app = create_gateway_app(
            sessions, Forwarder(client, Workers(["https://127.0.0.1:9"]), upstream), credentials=Credentials()
        )
        server = WorkerServer(app, host="127.0.0.1", port=0, tls=TlsFiles(certfile, keyfile))
        await server.start()
        try:
            assert server.url.startswith("https://")
            async with httpx.AsyncClient(verify=client_verify(cafile)) as verified:
                assert (await verified.get(f"{server.url}/health")).status_code == 200
            async with httpx.AsyncClient(verify=client_verify(None)) as unverified:
                with pytest.raises(httpx.ConnectError):  # the system's roots do not know the test CA
                    await unverified.get(f"{server.url}/health")
        finally:
            await server.stop()
