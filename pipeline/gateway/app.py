"""The gateway's HTTP surface: rollout sessions in front of the workers.

- ``POST /rollouts`` (optional ``rollout_id``, ``group_id``; the environment's credential)
  → ``{rollout_id, group_id, base_url, anthropic_base_url, api_key}``: what the agent
  gets, and nothing more. ``api_key`` is the agent's capability for this one rollout.
  Paced (``pacing``), a 429 with ``Retry-After`` while the trainer is too far behind.
- ``{gateway}/rollouts/{id}/v1`` is an OpenAI base URL (chat completions, completions,
  Responses) and ``{gateway}/rollouts/{id}`` an Anthropic one (``/v1/messages``); they
  take only that rollout's capability, and only for a rollout opened before.
- ``POST /rollouts/{id}/seal`` with ``{"reward": float}`` or ``{"status": "failed",
  "reason": str}``; ``GET /rollouts/{id}`` shows the calls and their parent links: both
  the environment's (or operator's), never the agent's (DESIGN §15).
- ``/health``, ``/metrics``: public, and they show no secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Literal

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.api.errors import InvalidRequest, parse_body
from pipeline.api.protocols import CHAT, PROTOCOLS, Protocol
from pipeline.api.protocols.turns import MalformedHistory
from pipeline.auth.audit import Audit
from pipeline.auth.capability import AgentCapabilities
from pipeline.auth.credentials import Credentials, Role
from pipeline.auth.gate import PUBLIC, Access, AuthGate, needs, presented_secret, principal_of
from pipeline.gateway.calls import Forwarder
from pipeline.gateway.history import history_of
from pipeline.gateway.metrics import gateway_registry
from pipeline.gateway.opening import Opening, opening_of, terms_of
from pipeline.gateway.pacing import AdmissionPacer, Paced
from pipeline.gateway.previous import PREVIOUS
from pipeline.gateway.quotas import QuotaExceeded, QuotaGuard, Quotas
from pipeline.gateway.sessions import SessionError, Sessions
from pipeline.worker import DEFAULT_MAX_BODY_BYTES
from pipeline.worker.limits import BodyLimit
from pipeline.worker.metrics import CONTENT_TYPE, render
from topics.records import IDENT_PATTERN, FiniteFloat, HistoryPolicy, SamplePolicy
from topics.wire import CAPTURE_FIELD

log = logging.getLogger(__name__)

SESSION_ERRORS: Protocol = CHAT
"""The session endpoints answer errors in OpenAI's shape."""

MODELS = "/v1/models"
"""Model discovery for both SDKs: ``{base_url}/models`` and ``{anthropic_base_url}/v1/models``."""
ENVIRONMENT = (Role.ENVIRONMENT, Role.OPERATOR)


def gateway_policy() -> dict[str, Access]:
    """Who may call each route of the gateway; a route missing here is refused (fail closed)."""
    policy: dict[str, Access] = {
        "/rollouts": needs(*ENVIRONMENT, action="open"),
        "/rollouts/{rollout_id}": needs(*ENVIRONMENT),
        "/rollouts/{rollout_id}/seal": needs(*ENVIRONMENT, action="seal"),
        "/health": PUBLIC,
        "/metrics": PUBLIC,
    }
    for protocol in PROTOCOLS.values():
        policy[f"/rollouts/{{rollout_id}}{protocol.path}"] = needs(Role.AGENT, protocol=protocol)
    policy[f"/rollouts/{{rollout_id}}{MODELS}"] = needs(Role.AGENT)
    return policy


class OpenRollout(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rollout_id: str | None = Field(None, pattern=IDENT_PATTERN, max_length=200)
    group_id: str | None = Field(None, min_length=1, max_length=200)
    history: HistoryPolicy = "exact"
    """What continuations' prompts hold of earlier turns: their exact tokens, or the
    template's render (a render that rewrites them starts a new segment, DESIGN §5.1)."""


class SealBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward: float | None = Field(None, allow_inf_nan=False)
    status: Literal["completed", "failed"] = "completed"
    reason: str | None = Field(None, min_length=1, max_length=200)
    sample_policy: SamplePolicy | None = None
    """Which chains become samples; None: the gateway's ``--sample-policy``."""
    all_or_nothing: bool | None = None
    call_rewards: dict[str, FiniteFloat] | None = Field(None, max_length=100_000)
    """Per-call rewards by call id (the ids ``GET /rollouts/{id}`` lists)."""

    @model_validator(mode="after")
    def _rules(self) -> SealBody:
        if self.status == "failed" and self.reason is None:
            raise ValueError("reason: a failed seal needs a reason")
        if self.status == "completed" and self.reason is not None:
            raise ValueError("reason: only a failed seal has a reason")
        return self


def create_gateway_app(
    sessions: Sessions,
    forwarder: Forwarder,
    *,
    sweep_every_s: float = 5.0,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    credentials: Credentials | None = None,
    capabilities: AgentCapabilities | None = None,
    quotas: Quotas | None = None,
    pacer: AdmissionPacer | None = None,
) -> FastAPI:
    """The app; its lifespan runs the idle-session sweeper.

    ``credentials``: the environment and operator secrets it checks (none: those routes
    are open, loopback only). ``capabilities``: how agent keys are issued and checked
    (default: a key in memory, so they end with the process). ``pacer``: holds new
    rollouts back while the trainer is too far behind (None: never).
    """
    credentials = credentials or Credentials()
    capabilities = capabilities or AgentCapabilities(credentials.agent_key)
    guard = QuotaGuard(quotas or Quotas())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        sweeper = asyncio.create_task(sessions.sweep_forever(sweep_every_s), name="session-sweeper")
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper

    app = FastAPI(
        title="tokentrail gateway",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        redirect_slashes=False,
    )
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    registry = gateway_registry(sessions, forwarder, guard, pacer)
    app.add_middleware(
        AuthGate,
        router=app.router,
        policy=gateway_policy(),
        credentials=credentials,
        audit=Audit(registry),
        capabilities=capabilities,
    )

    @app.exception_handler(SessionError)
    async def session_error(_: Request, exc: SessionError) -> JSONResponse:
        return SESSION_ERRORS.error(exc.status, exc.message)

    @app.exception_handler(InvalidRequest)
    async def invalid(_: Request, exc: InvalidRequest) -> JSONResponse:
        return SESSION_ERRORS.error(400, exc.message, param=exc.param)

    @app.post("/rollouts")
    async def open_rollout(request: Request) -> JSONResponse:
        body = parse_body(OpenRollout, await _body(request, allow_empty=True))
        if pacer is not None:
            try:
                await pacer.check()
            except Paced as exc:
                refused = SESSION_ERRORS.error(429, exc.message, param="max_staleness")
                refused.headers["Retry-After"] = pacer.pacing.retry_after
                return refused
        session = sessions.open(body.rollout_id, body.group_id, body.history)
        if pacer is not None:
            pacer.opened()
        base = str(request.base_url).rstrip("/")
        return JSONResponse(
            {
                "rollout_id": session.rollout_id,
                "group_id": session.group_id,
                "history": session.history,
                "base_url": f"{base}/rollouts/{session.rollout_id}/v1",
                "anthropic_base_url": f"{base}/rollouts/{session.rollout_id}",
                "api_key": capabilities.issue(
                    session.rollout_id, terms_of(session.group_id, session.history)
                ),
            }
        )

    @app.get("/rollouts/{rollout_id}")
    async def show(rollout_id: str) -> JSONResponse:
        return JSONResponse(await sessions.describe(rollout_id))

    @app.post("/rollouts/{rollout_id}/seal")
    async def seal(rollout_id: str, request: Request) -> JSONResponse:
        body = parse_body(SealBody, await _body(request))
        failed = body.reason if body.status == "failed" else None
        sealed = await sessions.seal(
            rollout_id,
            reward=body.reward,
            failed=failed,
            sample_policy=body.sample_policy,
            all_or_nothing=body.all_or_nothing,
            sealed_by=str(principal_of(request)),
            call_rewards=body.call_rewards,
        )
        return JSONResponse(sealed.model_dump(mode="json"))

    def opening(request: Request) -> Opening | None:
        """The opening the agent's key carries, if it is this rollout's (unchecked without credentials)."""
        secret, rollout_id = presented_secret(request.headers), request.path_params["rollout_id"]
        if secret is None or not capabilities.verify(rollout_id, secret):
            return None
        return opening_of(capabilities.terms(secret))

    for protocol in PROTOCOLS.values():
        app.post(f"/rollouts/{{rollout_id}}{protocol.path}")(
            _agent_route(sessions, forwarder, guard, protocol, opening)
        )

    @app.get(f"/rollouts/{{rollout_id}}{MODELS}")
    async def models(rollout_id: str, request: Request) -> Response:
        await sessions.held(rollout_id, opening(request))  # an open session's agent only; admits nothing
        return await forwarder.models(anthropic="anthropic-version" in request.headers)

    @app.get("/health")
    async def health() -> JSONResponse:
        workers = [
            {"url": u, "in_flight": f, "failures": e, "healthy": h}
            for u, f, e, h in forwarder.workers.stats()
        ]
        return JSONResponse({"status": "ok", "open_sessions": sessions.open_count, "workers": workers})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(registry), media_type=CONTENT_TYPE)

    return app


def _agent_route(
    sessions: Sessions,
    forwarder: Forwarder,
    guard: QuotaGuard,
    protocol: Protocol,
    opening: Callable[[Request], Opening | None],
) -> Any:
    async def serve(rollout_id: str, request: Request) -> Response:
        try:
            raw = await request.body()
            body = _parsed(raw)
            if not isinstance(body, dict):
                raise InvalidRequest(None, "body: must be a JSON object")
            if CAPTURE_FIELD in body:
                raise InvalidRequest(CAPTURE_FIELD, f"{CAPTURE_FIELD}: the gateway admits calls itself")
            # opened by its environment (here, or on another replica: the key's terms say how)
            session = await sessions.held(rollout_id, opening(request))
            guard.check(session, len(raw))
            forwarded = body
            if protocol.stores_responses and PREVIOUS in body:  # the conversation the worker does not keep
                forwarded = session.responses.expand(body)
            history = history_of(protocol, forwarded)
        except (InvalidRequest, MalformedHistory) as exc:
            return protocol.error(400, exc.message, param=exc.param)
        except SessionError as exc:
            return protocol.error(exc.status, exc.message)
        except QuotaExceeded as exc:
            return protocol.error(429, exc.message, param=exc.limit)
        guard.charge(session, len(raw))
        session.last_seen = sessions.clock()

        def remember(reply: Mapping[str, Any]) -> None:
            session.responses.remember(body, reply)

        on_reply = remember if protocol.stores_responses else None
        return await forwarder.call(session, protocol, forwarded, history, on_reply=on_reply)

    return serve


async def _body(request: Request, *, allow_empty: bool = False) -> Any:
    raw = await request.body()
    if not raw and allow_empty:
        return {}
    return _parsed(raw)


def _parsed(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(None, f"body: not valid JSON ({exc})") from None


__all__ = ["create_gateway_app", "gateway_policy"]
