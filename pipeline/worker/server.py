"""The worker's HTTP surface: OpenAI chat completions with capture, refit admin, health, metrics.

``POST /v1/chat/completions`` accepts ``ng_capture`` (a ``CaptureAdmission``) and returns
``ng_commit_coords``. Under ack policy ``staged`` the handler awaits the staged coords
before replying (the engine never waits: capture already ran synchronously and the
row is with the background writer); under ``enqueued`` it replies at once.

Refits (DESIGN §8): ``/admin/pause`` → ``/admin/reload_weights`` →
``/admin/weight_version`` → ``/admin/resume``. Calls in flight keep their place and
record the per-token version spans.

Request bodies are bounded (``max_body_bytes``): a bigger one is answered 413 before
any of it is parsed, so one client cannot make the worker buffer or parse gigabytes.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline.worker import DEFAULT_MAX_BODY_BYTES
from pipeline.worker.metrics import CONTENT_TYPE, render, worker_registry
from pipeline.worker.protocol import (
    ChatCompletionRequest,
    InvalidRequest,
    ReloadWeights,
    SetWeightVersion,
    chat_completion,
    error_body,
    models_list,
    parse_body,
)
from stages.capture.engine import EngineUnavailable
from stages.capture.vllm.worker import RequestRejected, VllmWorker, WorkerStateError
from topics.wire import strip_token_fields

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


def _error(
    status: int, message: str, *, param: str | None = None, kind: str = "invalid_request_error"
) -> JSONResponse:
    return JSONResponse(error_body(message, param=param, kind=kind), status_code=status)


async def _json(request: Request) -> Any:
    raw = await request.body()
    try:
        return orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(None, f"body: not valid JSON ({exc})") from None


def create_app(
    worker: VllmWorker,
    *,
    model_name: str,
    worker_id: str,
    manage_worker: bool = True,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The app around one ``VllmWorker``; request bodies over ``max_body_bytes`` get a 413.

    With ``manage_worker`` the app's lifespan starts the worker and, on shutdown (after
    the server finished in-flight requests), drains its staging writer. Tests that drive
    the app without a lifespan call ``worker.start()``/``worker.stop()`` themselves.
    """

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_worker:
            await worker.start()
        try:
            yield
        finally:
            if manage_worker:
                await worker.stop()
                log.info("worker %s drained its staging writer", worker_id)

    app = FastAPI(title="tokentrail worker", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    registry = worker_registry(worker, worker_id)

    @app.exception_handler(InvalidRequest)
    async def invalid(_: Request, exc: InvalidRequest) -> JSONResponse:
        return _error(400, exc.message, param=exc.param)

    @app.exception_handler(RequestRejected)
    async def rejected(_: Request, exc: RequestRejected) -> JSONResponse:
        message = exc.message if exc.param is None else f"{exc.param}: {exc.message}"
        return _error(400, message, param=exc.param)

    @app.exception_handler(WorkerStateError)
    async def conflict(_: Request, exc: WorkerStateError) -> JSONResponse:
        return _error(409, str(exc), kind="conflict")

    @app.exception_handler(EngineUnavailable)
    async def unavailable(_: Request, exc: EngineUnavailable) -> JSONResponse:
        return _error(503, f"engine unavailable: {exc}", kind="server_error")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        body = parse_body(ChatCompletionRequest, await _json(request))
        call = body.chat_call()
        admission = body.admission()  # validated before anything is captured
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        served = await worker.chat(call, admission, response_id=response_id)
        coords = None if served.completion is None else await served.completion.final_coords()
        reply = chat_completion(served, model=body.model or model_name, coords=coords)
        return JSONResponse(strip_token_fields(reply))

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(models_list([model_name]))

    def _admin(action: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[JSONResponse]]:
        async def run() -> JSONResponse:
            await action()
            return JSONResponse(_state(worker))

        return run

    app.post("/admin/pause")(_admin(worker.pause))
    app.post("/admin/resume")(_admin(worker.resume))

    @app.post("/admin/reload_weights")
    async def reload_weights(request: Request) -> JSONResponse:
        body = parse_body(ReloadWeights, await _json(request))
        await worker.reload_weights(body.path)
        return JSONResponse({**_state(worker), "path": body.path})

    @app.post("/admin/weight_version")
    async def set_weight_version(request: Request) -> JSONResponse:
        body = parse_body(SetWeightVersion, await _json(request))
        await worker.set_weight_version(body.version)
        return JSONResponse(_state(worker))

    @app.get("/admin/weight_version")
    async def get_weight_version() -> JSONResponse:
        return JSONResponse(_state(worker))

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse(
            {
                "status": "ok",
                "worker_id": worker_id,
                "writer_backlog": worker.core.writer.backlog,
                **_state(worker),
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(registry), media_type=CONTENT_TYPE)

    return app


def _state(worker: VllmWorker) -> dict[str, Any]:
    return {"version": worker.weight_version, "paused": worker.paused}
