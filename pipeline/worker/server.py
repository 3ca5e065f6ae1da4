"""The worker's HTTP surface: vLLM's protocols with capture, refit admin, health, metrics.

The generation routes (``pipeline.worker.routes``) accept ``ng_capture`` and return
``ng_commit_coords``. Refits (DESIGN §8): ``/admin/pause`` → ``/admin/reload_weights`` →
``/admin/weight_version`` → ``/admin/resume``; vLLM's own RL endpoints (``/pause``,
``/resume``, ``/is_paused``, ``/update_weight_version``, ``/weight_info``, ...) are served
too, on the same capturing client, so a version set either way stamps the calls.

Every route states who may call it (``worker_policy``, DESIGN §15): generation with
``ng_capture`` needs the service credential, admin and vLLM's RL routes the operator's,
plain generation the ``api.key`` if one is set; ``/health`` and ``/metrics`` are public.

Request bodies are bounded (``max_body_bytes``, ``pipeline.worker.limits``): a bigger
one is answered 413 before any of it is parsed.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from vllm.entrypoints.rl.online.api_router import router as rl_router

from pipeline.api.errors import InvalidRequest, error_body, parse_body
from pipeline.api.protocols import PROTOCOLS
from pipeline.auth.audit import Audit
from pipeline.auth.credentials import Credentials, Role
from pipeline.auth.gate import PUBLIC, Access, AuthGate, needs
from pipeline.worker import DEFAULT_MAX_BODY_BYTES
from pipeline.worker.limits import BodyLimit
from pipeline.worker.metrics import CONTENT_TYPE, render, worker_registry
from pipeline.worker.protocol import ReloadWeights, SetWeightVersion
from pipeline.worker.routes import add_generation_routes
from pipeline.worker.serving import Serving
from stages.capture.vllm.client import InvalidWeightVersion
from stages.capture.vllm.engine import EngineUnavailable
from stages.capture.vllm.worker import RequestRejected, VllmWorker, WorkerStateError

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


CAPTURE_ROLES = frozenset({Role.SERVICE, Role.OPERATOR})
ADMIN_ACTIONS = {
    "/admin/pause": "pause",
    "/admin/resume": "resume",
    "/admin/reload_weights": "reload_weights",
    "/admin/weight_version": "weight_version",
}


def worker_policy() -> dict[str, Access]:
    """Who may call each route of the worker; a route missing here is refused (fail closed)."""
    callers = (Role.CLIENT, Role.SERVICE, Role.OPERATOR)
    policy: dict[str, Access] = {
        protocol.path: needs(*callers, protocol=protocol) for protocol in PROTOCOLS.values()
    }
    policy["/v1/models"] = needs(*callers)
    policy.update({path: needs(Role.OPERATOR, action=name) for path, name in ADMIN_ACTIONS.items()})
    for route in rl_router.routes:  # vLLM's RL routes, whichever it has
        path = getattr(route, "path", "")
        changes = "POST" in (getattr(route, "methods", None) or ())
        policy[path] = needs(Role.OPERATOR, action=f"vllm{path.replace('/', ':')}" if changes else None)
    policy["/health"] = PUBLIC
    policy["/metrics"] = PUBLIC
    return policy


def create_app(
    worker: VllmWorker,
    serving: Serving,
    *,
    worker_id: str,
    manage_worker: bool = True,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    credentials: Credentials | None = None,
) -> FastAPI:
    """The app around one ``VllmWorker``; request bodies over ``max_body_bytes`` get a 413.

    ``credentials`` are the secrets it checks; None or empty: every role route is open,
    which the bind rule allows on loopback only (``pipeline.auth.transport``).

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

    app = FastAPI(
        title="tokentrail worker", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.state.engine_client = worker.client  # what vLLM's RL endpoints act on
    registry = worker_registry(worker, worker_id)
    credentials = credentials or Credentials()
    audit = Audit(registry)
    app.add_middleware(
        AuthGate, router=app.router, policy=worker_policy(), credentials=credentials, audit=audit
    )

    @app.exception_handler(InvalidRequest)
    async def invalid(_: Request, exc: InvalidRequest) -> JSONResponse:
        return _error(400, exc.message, param=exc.param)

    @app.exception_handler(RequestRejected)
    async def rejected(_: Request, exc: RequestRejected) -> JSONResponse:
        message = exc.message if exc.param is None else f"{exc.param}: {exc.message}"
        return _error(400, message, param=exc.param)

    @app.exception_handler(InvalidWeightVersion)
    async def bad_version(_: Request, exc: InvalidWeightVersion) -> JSONResponse:
        return _error(400, str(exc), param="version")

    @app.exception_handler(WorkerStateError)
    async def conflict(_: Request, exc: WorkerStateError) -> JSONResponse:
        return _error(409, str(exc), kind="conflict")

    @app.exception_handler(EngineUnavailable)
    async def unavailable(_: Request, exc: EngineUnavailable) -> JSONResponse:
        return _error(503, f"engine unavailable: {exc}", kind="server_error")

    add_generation_routes(
        app, worker, serving, audit=audit, capture_roles=CAPTURE_ROLES if credentials.enabled else None
    )
    app.include_router(rl_router)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        listed = await serving.models.show_available_models()
        return JSONResponse(listed.model_dump(mode="json"))

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
