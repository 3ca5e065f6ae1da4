"""Credentials, agent capabilities, the route gate and the bind rule, without an engine."""

from __future__ import annotations

import secrets
import stat
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.api.protocols import MESSAGES
from pipeline.auth.audit import Audit
from pipeline.auth.capability import AgentCapabilities
from pipeline.auth.credentials import CredentialError, Credentials, Role
from pipeline.auth.gate import PUBLIC, AuthGate, needs, principal_of, unguarded_routes
from pipeline.auth.transport import InsecureBind, check_bind, is_loopback
from pipeline.gateway.quotas import QuotaExceeded, QuotaGuard, Quotas
from pipeline.gateway.sessions import Sessions
from stages.client import RolloutClient
from stages.memory import RecordingSink

TOKENS = {role: secrets.token_urlsafe(32) for role in (Role.ENVIRONMENT, Role.OPERATOR)}
POLICY = {
    "/seal/{rollout_id}": needs(Role.ENVIRONMENT, Role.OPERATOR, action="seal"),
    "/rollouts/{rollout_id}/call": needs(Role.AGENT, protocol=MESSAGES),
    "/health": PUBLIC,
}


def app_with(credentials: Credentials, capabilities: AgentCapabilities) -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    async def who(request: Request, rollout_id: str = "") -> JSONResponse:
        return JSONResponse({"principal": str(principal_of(request))})

    for path in [*POLICY, "/forgotten"]:
        app.post(path)(who)
    app.add_middleware(
        AuthGate,
        router=app.router,
        policy=POLICY,
        credentials=credentials,
        audit=Audit(),
        capabilities=capabilities,
    )
    return app


async def post(app: FastAPI, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post(path, headers=headers or {})


@pytest.mark.anyio
async def test_the_gate_admits_each_role_only_where_the_policy_says() -> None:
    caps = AgentCapabilities(secrets.token_bytes(32))
    app = app_with(Credentials(dict(TOKENS)), caps)
    env = {"authorization": f"Bearer {TOKENS[Role.ENVIRONMENT]}"}
    sealed = await post(app, "/seal/r1", env)
    assert sealed.status_code == 200 and sealed.json()["principal"].startswith("environment:")
    assert TOKENS[Role.ENVIRONMENT] not in sealed.text
    assert (await post(app, "/seal/r1")).status_code == 401
    assert (await post(app, "/seal/r1", {"authorization": "Bearer " + "x" * 40})).status_code == 401
    agent = {"x-api-key": caps.issue("r1")}
    assert (await post(app, "/seal/r1", agent)).status_code == 401  # an agent key is no role
    called = await post(app, "/rollouts/r1/call", agent)
    assert called.json() == {"principal": "agent:r1"}
    other = await post(app, "/rollouts/r2/call", agent)
    assert other.status_code == 401 and other.json()["type"] == "error"  # Anthropic's shape
    assert (await post(app, "/rollouts/r1/call", env)).status_code == 403  # a role, but not this one
    assert (await post(app, "/forgotten", env)).status_code == 403  # no policy: refused
    assert (await post(app, "/health")).status_code == 200
    assert unguarded_routes(app, POLICY) == ["/forgotten"]


@pytest.mark.anyio
async def test_without_credentials_role_routes_are_open_but_agent_keys_are_still_checked() -> None:
    app = app_with(Credentials(), AgentCapabilities())
    assert (await post(app, "/seal/r1")).json() == {"principal": "anonymous"}
    assert (await post(app, "/rollouts/r1/call")).status_code == 401


@given(
    st.text(min_size=1, max_size=40).filter(lambda s: s.isprintable()), st.binary(min_size=32, max_size=32)
)
@settings(max_examples=200, deadline=None)
def test_a_capability_is_bound_to_its_rollout(rollout_id: str, key: bytes) -> None:
    caps = AgentCapabilities(key)
    issued = caps.issue(rollout_id)
    assert caps.verify(rollout_id, issued) and len(issued) >= 4 + 43  # 256 bits
    assert not caps.verify(rollout_id + "x", issued)
    assert not AgentCapabilities(bytes(32)).verify(rollout_id, issued) or key == bytes(32)


@given(st.text(min_size=1, max_size=40).filter(lambda s: s.isprintable() and "\n" not in s))
@settings(max_examples=100, deadline=None)
def test_a_capability_carries_terms_it_binds(terms: str) -> None:
    """Terms are read back as issued, and a key whose terms were changed, or moved to
    another rollout, is refused."""
    caps = AgentCapabilities(bytes(range(32)))
    issued = caps.issue("r1", terms)
    assert caps.verify("r1", issued) and caps.terms(issued) == terms
    assert not caps.verify("r2", issued)
    forged = issued.split(".")[0] + "." + caps.issue("r1", terms + "x").split(".")[1]
    assert not caps.verify("r1", forged) and not caps.verify("r1", issued.split(".")[0])
    assert caps.terms(caps.issue("r1")) == "" and caps.terms("tta_x.%%%") == ""


def test_minted_credentials_are_private_and_kept(tmp_path: Path) -> None:
    directory = tmp_path / "credentials"
    first = Credentials.mint(directory)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for path in directory.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert Credentials.mint(directory).tokens == first.tokens  # a later run reads the same
    assert first.enabled and first.agent_key is not None
    assert all(secret not in repr(first) for secret in first.tokens.values())


def test_bad_secrets_are_refused_naming_their_source(tmp_path: Path) -> None:
    (tmp_path / "operator.token").write_text("short\n")
    with pytest.raises(CredentialError, match=r"operator\.token") as caught:
        Credentials.load(tmp_path, environ={})
    assert "short" not in str(caught.value)
    with pytest.raises(CredentialError, match="TOKENTRAIL_SERVICE_TOKEN"):
        Credentials.load(None, environ={"TOKENTRAIL_SERVICE_TOKEN": "a b" * 20})
    loaded = Credentials.load(None, environ={"TOKENTRAIL_OPERATOR_TOKEN": "o" * 40})
    assert loaded.token(Role.OPERATOR) == "o" * 40


def test_a_non_loopback_bind_needs_credentials_or_an_explicit_waiver() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.internal")
    check_bind("127.0.0.1", Credentials(), insecure_no_auth=False, what="worker")
    with pytest.raises(InsecureBind, match=r"--host 0\.0\.0\.0"):
        check_bind("0.0.0.0", Credentials(), insecure_no_auth=False, what="worker")
    check_bind("0.0.0.0", Credentials(), insecure_no_auth=True, what="worker")
    check_bind("0.0.0.0", Credentials(dict(TOKENS)), insecure_no_auth=False, what="worker")


def test_quotas_name_the_bad_field() -> None:
    with pytest.raises(ValueError, match="max_calls"):
        Quotas(max_calls=0)


def test_a_rollout_over_a_quota_is_refused_naming_the_limit_and_stays_usable() -> None:
    sessions = Sessions(RolloutClient(RecordingSink()), ttl_s=60)
    session = sessions.open("r1")
    guard = QuotaGuard(Quotas(max_in_flight=1, max_calls=2, max_request_bytes=100))
    guard.check(session, 10)
    guard.charge(session, 10)
    session.in_flight = 1
    with pytest.raises(QuotaExceeded) as caught:
        guard.check(session, 10)
    assert caught.value.limit == "max_in_flight"
    session.in_flight = 0
    with pytest.raises(QuotaExceeded, match="max_request_bytes"):
        guard.check(session, 95)
    guard.check(session, 10)  # still capturable within its limits
    guard.charge(session, 10)
    with pytest.raises(QuotaExceeded, match="max_calls"):
        guard.check(session, 1)
    assert guard.refused == {"max_in_flight": 1, "max_request_bytes": 1, "max_calls": 1}
