"""Fuzzing the HTTP surfaces from their route tables (each app's access policy is its
schema): random paths, methods, credentials and JSON bodies.

The gateway is fuzzed whole, in front of a recording sink: nothing answers 5xx, and
nothing without the right credential is accepted or publishes an event. The inspector is
fuzzed whole over an empty data directory: nothing without the operator's credential is
shown. The worker's
gate is fuzzed with the worker's own policy in front of handlers that record being
reached (the real worker, engine and all, is attacked route by route in
``tests/security/test_escape.py``): no request without the right role reaches one.
"""

from __future__ import annotations

import asyncio
import secrets
import tempfile
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.auth.audit import Audit
from pipeline.auth.capability import AgentCapabilities
from pipeline.auth.credentials import Credentials, Role
from pipeline.auth.gate import AuthGate
from pipeline.gateway.app import create_gateway_app, gateway_policy
from pipeline.gateway.calls import Forwarder
from pipeline.gateway.sessions import Sessions
from pipeline.gateway.upstream import Workers
from pipeline.inspect.app import create_inspect_app, inspect_policy
from pipeline.inspect.log import LogUnavailable
from pipeline.inspect.source import RunSource
from pipeline.samples.archive import archive_path
from pipeline.worker.server import worker_policy
from stages.client import RolloutClient
from stages.memory import RecordingSink

CREDENTIALS = Credentials(
    {
        role: secrets.token_urlsafe(32)
        for role in (Role.ENVIRONMENT, Role.OPERATOR, Role.SERVICE, Role.CLIENT)
    },
    agent_key=secrets.token_bytes(32),
)
CAPABILITIES = AgentCapabilities(CREDENTIALS.agent_key)
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.integers()
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
ROLLOUT = st.sampled_from(["r1", "r2", "nobody"]) | st.text(
    st.characters(min_codepoint=48, max_codepoint=122), min_size=1, max_size=12
)
WHO = st.sampled_from(
    ["none", "forged", "agent-r1", "x-api-key-r1", *(role.value for role in Role if role != Role.AGENT)]
)
METHOD = st.sampled_from(["GET", "POST", "PUT", "DELETE"])
REFUSED = (401, 403, 404, 405)


def headers_for(who: str) -> dict[str, str]:
    if who == "none":
        return {}
    if who == "forged":
        return {"authorization": f"Bearer tta_{secrets.token_urlsafe(32)}"}
    if who == "agent-r1":
        return {"authorization": f"Bearer {CAPABILITIES.issue('r1')}"}
    if who == "x-api-key-r1":
        return {"x-api-key": CAPABILITIES.issue("r1")}
    return CREDENTIALS.authorization(Role(who))


def entitled(roles: frozenset[Role], public: bool, who: str, rollout: str) -> bool:
    is_agent_of_r1 = who in ("agent-r1", "x-api-key-r1") and rollout == "r1"
    return public or (Role.AGENT in roles and is_agent_of_r1) or (who in set(roles) - {Role.AGENT})


@given(template=st.sampled_from(sorted(gateway_policy())), method=METHOD, rollout=ROLLOUT, who=WHO, body=JSON)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_gateway_answers_no_5xx_and_accepts_no_unentitled_request(
    template: str, method: str, rollout: str, who: str, body: Any
) -> None:
    sink = RecordingSink()
    path = template.replace("{rollout_id}", rollout)
    response = asyncio.run(_gateway_request(sink, method, path, headers_for(who), body))
    assert response.status_code < 500 or response.status_code == 503, (path, response.text[:200])
    access = gateway_policy()[template]
    if not entitled(access.roles, access.public, who, rollout):
        assert response.status_code in REFUSED, (who, path, response.status_code)
        assert sink.events == [], (who, path)


async def _gateway_request(
    sink: RecordingSink, method: str, path: str, headers: dict[str, str], body: Any
) -> httpx.Response:
    client = RolloutClient(sink)
    async with httpx.AsyncClient() as upstream:
        sessions = Sessions(client, ttl_s=60)
        sessions.open("r1")
        sessions.open("r2")
        forwarder = Forwarder(client, Workers(["http://127.0.0.1:9"]), upstream)  # nothing listens
        app = create_gateway_app(sessions, forwarder, credentials=CREDENTIALS, capabilities=CAPABILITIES)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
            return await http.request(method, path, json=body, headers=headers)


def _recording_worker_app(reached: list[str]) -> FastAPI:
    """The worker's routes and gate, each handler only recording that it was reached."""
    app = FastAPI(redirect_slashes=False)
    for path in worker_policy():

        async def handler(request: Request) -> dict[str, str]:
            reached.append(request.url.path)
            return {}

        app.add_api_route(path, handler, methods=["GET", "POST"])
    app.add_middleware(
        AuthGate, router=app.router, policy=worker_policy(), credentials=CREDENTIALS, audit=Audit()
    )
    return app


@given(template=st.sampled_from(sorted(worker_policy())), method=METHOD, who=WHO, body=JSON)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_worker_gate_lets_no_unentitled_request_reach_a_handler(
    template: str, method: str, who: str, body: Any
) -> None:
    reached: list[str] = []
    app = _recording_worker_app(reached)

    async def send() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as http:
            return await http.request(method, template, json=body, headers=headers_for(who))

    response = asyncio.run(send())
    access = worker_policy()[template]
    if entitled(access.roles, access.public, who, rollout=""):
        assert response.status_code in (200, 405), (who, template, response.text[:200])
    else:
        assert response.status_code in REFUSED, (who, template, response.status_code)
        assert reached == [], (who, template)


INSPECTED = tempfile.TemporaryDirectory(prefix="inspected-")  # removed when the session ends


def _inspector() -> Any:
    data_dir = Path(INSPECTED.name)
    archive_path(data_dir).touch()
    return create_inspect_app(RunSource(data_dir, LogUnavailable("no log here"), None), CREDENTIALS)


INSPECTOR = _inspector()


@given(template=st.sampled_from(sorted(inspect_policy())), method=METHOD, rollout=ROLLOUT, who=WHO)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_inspector_shows_nothing_without_the_operator(
    template: str, method: str, rollout: str, who: str
) -> None:
    path = (
        template.replace("{rollout_id}", rollout)
        .replace("{sample_key}", rollout)
        .replace("{group_id}", rollout)
    )

    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=INSPECTOR)
        async with httpx.AsyncClient(transport=transport, base_url="http://i") as http:
            return await http.request(method, path, headers=headers_for(who))

    response = asyncio.run(send())
    assert response.status_code < 500, (path, response.text[:200])
    access = inspect_policy()[template]
    if not entitled(access.roles, access.public, who, rollout):
        assert response.status_code in REFUSED, (who, path, response.status_code)
