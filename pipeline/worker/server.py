"""The worker's HTTP surface: OpenAI chat completions with capture, refit admin, health, metrics.

``POST /v1/chat/completions`` accepts ``ng_capture`` (a ``CaptureAdmission``) and returns
``ng_commit_coords``. Under ack policy ``staged`` the handler awaits the staged coords
before replying (the engine never waits: capture already ran synchronously and the
row is with the background writer); under ``enqueued`` it replies at once.

Refits (DESIGN §8): ``/admin/pause`` → ``/admin/reload_weights`` →
``/admin/weight_version`` → ``/admin/resume``. Calls in flight keep their place and
record the per-token version spans.
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
from stages.capture.vllm_engine import EngineUnavailable
from stages.capture.vllm_worker import RequestRejected, VllmWorker, WorkerStateError
from stages.client import strip_token_fields

log = logging.getLogger(__name__)


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
) -> FastAPI:
    """The app around one ``VllmWorker``.

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
