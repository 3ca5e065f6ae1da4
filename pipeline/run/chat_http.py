"""The rollout driver's ``ChatEndpoint`` over real HTTP (httpx).

The driver in ``stages`` only knows the protocol; this is the implementation a
single-machine run (or any driver process) uses against a worker's OpenAI-compatible
``/v1/chat/completions``. Going through a real socket, rather than an in-process ASGI
call, exercises exactly what a remote agent framework would: JSON in, JSON out, no
token ids on the wire.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any, Self

import httpx
import orjson

CHAT_PATH = "/v1/chat/completions"


class ChatRequestError(RuntimeError):
    """The worker answered a chat request with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class HttpChatEndpoint:
    """POSTs chat bodies to ``{base_url}/v1/chat/completions`` and returns the parsed reply.

    One connection pool serves every concurrent rollout; ``timeout_s`` bounds each call
    (a stuck worker then breaks the rollout, which the driver seals as failed).
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 120.0,
        max_connections: int = 64,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """``headers``: the service credential, which capture needs (DESIGN §15)."""
        self.base_url = base_url.rstrip("/")
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=dict(headers or {}),
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            trust_env=False,  # a loopback worker must not go through an HTTP(S)_PROXY
        )

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        response = await self._client.post(
            CHAT_PATH, content=orjson.dumps(body), headers={"content-type": "application/json"}
        )
        if response.status_code != 200:
            raise ChatRequestError(response.status_code, _error_message(response))
        reply = orjson.loads(response.content)
        if not isinstance(reply, dict):
            raise ChatRequestError(response.status_code, "reply is not a JSON object")
        return reply

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


def _error_message(response: httpx.Response) -> str:
    """The OpenAI-style ``error.message`` if there is one, else the start of the body."""
    try:
        body = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return response.text[:200]
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", ""))[:200]
    return response.text[:200]
