"""Request bodies bounded before the app reads them: one client cannot make the worker buffer gigabytes."""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline.api.errors import error_body

log = logging.getLogger(__name__)


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets a 413 before the app sees it.

    A declared ``Content-Length`` over the limit is refused without reading the body; a
    chunked body is counted as it arrives and refused as soon as it passes the limit.
    A body within the limit is handed to the app whole, so nothing the app parses can
    be larger than the limit.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes: must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, send, f"declares {declared} bytes")
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before its body was complete
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, send, f"passed {self.max_bytes} bytes while streaming")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if delivered:
                return await receive()  # after the body: the client's disconnect, if any
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, send: Send, detail: str) -> None:
        log.warning("refused a %s %s body that %s", scope.get("method"), scope.get("path"), detail)
        message = f"request body too large: the limit is {self.max_bytes} bytes (--max-body-bytes)"
        response = JSONResponse(
            error_body(message, code="request_too_large"),
            status_code=413,
            headers={"connection": "close"},  # the rest of the body is never read
        )
        await response(scope, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server's HTTP parser refuses a malformed length itself
    return None
