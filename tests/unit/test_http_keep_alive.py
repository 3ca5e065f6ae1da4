"""The servers keep an idle connection open longer than their clients do.

httpx (and so the openai SDK and the gateway's own client) drops an idle connection after
5 s; a server that closed it at that same moment raced the client's next request, which then
failed with a read error mid-run. The server must never be the one to close first.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI

from pipeline.worker.main import WorkerServer

REQUEST = b"GET /ping HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(REQUEST)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return head + await reader.readexactly(length)


@pytest.mark.anyio
async def test_an_idle_connection_outlives_the_clients_own_idle_expiry() -> None:
    app = FastAPI()
    app.get("/ping")(lambda: {"ok": True})
    server = WorkerServer(app, host="127.0.0.1", port=0, graceful_timeout_s=1)
    await server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        assert (await _exchange(reader, writer)).startswith(b"HTTP/1.1 200")
        client_expiry = httpx.Limits().keepalive_expiry
        assert client_expiry is not None
        await asyncio.sleep(client_expiry + 1)  # the client would have dropped it by now
        assert (await _exchange(reader, writer)).startswith(b"HTTP/1.1 200"), "the server closed first"
        writer.close()
    finally:
        await server.stop()
