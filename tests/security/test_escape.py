"""The escape suite: an agent holding exactly what the gateway gave it tries every route
that is not its own, on the gateway, the worker and the inspector, and must change nothing.

The routes come from the apps' own route tables, so a route added later is attacked by
default (and one without an access policy fails ``test_every_route_states_its_roles``).
Each attack is sent with the agent's key as a bearer token and as ``x-api-key``, on its
own rollout and on another agent's. Afterwards: both rollouts still open, the weight
version and pause state unchanged, no event published by gateway or worker, no row staged.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from enginekit import EngineHost, Rig, start_rig
from escapekit import EscapeReport
from fastapi.routing import APIRoute

from pipeline.auth.credentials import Credentials, Role
from pipeline.auth.gate import unguarded_routes
from pipeline.gateway.app import gateway_policy
from pipeline.gateway.main import Gateway, GatewayConfig, gateway
from pipeline.gateway.pacing import Pacing
from pipeline.inspect.app import create_inspect_app, inspect_policy
from pipeline.inspect.log import LogUnavailable
from pipeline.inspect.source import RunSource
from pipeline.samples.archive import archive_path
from pipeline.worker.main import WorkerServer
from pipeline.worker.server import worker_policy
from topics.wire import CAPTURE_FIELD

pytestmark = [pytest.mark.slow, pytest.mark.engine]

CREDENTIALS = Credentials(
    {
        role: secrets.token_urlsafe(32)
        for role in (Role.ENVIRONMENT, Role.OPERATOR, Role.SERVICE, Role.CLIENT)
    },
    agent_key=secrets.token_bytes(32),
)
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@dataclass
class Perimeter:
    rig: Rig
    built: Gateway
    server: WorkerServer
    inspector: WorkerServer
    mine: dict[str, Any]
    other: dict[str, Any]

    @property
    def url(self) -> str:
        return self.server.url

    def as_role(self, role: Role, method: str, url: str, body: Any = None) -> httpx.Response:
        return httpx.request(method, url, json=body, headers=CREDENTIALS.authorization(role), timeout=60)

    def state(self) -> tuple[Any, ...]:
        """Everything an attack must not change."""
        version = self.as_role(Role.OPERATOR, "GET", f"{self.rig.url}/admin/weight_version").json()
        shown = [
            self.as_role(Role.ENVIRONMENT, "GET", f"{self.url}/rollouts/{o['rollout_id']}").json()
            for o in (self.mine, self.other)
        ]
        return (
            version,
            [(s["sealed"], len(s["calls"])) for s in shown],
            len(self.rig.driver_sink.events),
            len(self.rig.worker_sink.events),
            len(self.rig.data_plane.calls),
            self.built.sessions.open_count,
        )


@pytest.fixture(scope="module")
def perimeter(
    host: EngineHost, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Perimeter]:
    rig = start_rig(host, model_dir, credentials=CREDENTIALS)
    # Paced: room for three rollouts at the workers' version 0 (pacing adds no route; the
    # gate answers before it, and a paced refusal shows nothing: see the reward-authority test).
    pacing = Pacing(max_staleness=0, rollouts_per_step=3)
    config = GatewayConfig(workers=(rig.url,), port=0, credentials=CREDENTIALS, pacing=pacing)
    data_dir = tmp_path_factory.mktemp("inspected")
    archive_path(data_dir).touch()
    inspected = RunSource(data_dir, LogUnavailable("no log in this test"), None)

    async def start() -> tuple[Any, Gateway, WorkerServer, WorkerServer]:
        context = gateway(config, rig.driver_sink)
        built = await context.__aenter__()
        server = WorkerServer(built.app, host="127.0.0.1", port=0, graceful_timeout_s=5)
        await server.start()
        inspector = WorkerServer(create_inspect_app(inspected, CREDENTIALS), host="127.0.0.1", port=0)
        await inspector.start()
        return context, built, server, inspector

    context, built, server, inspector = rig.host.run(start())
    try:
        opened = [
            httpx.post(
                f"{server.url}/rollouts", json={}, headers=CREDENTIALS.authorization(Role.ENVIRONMENT)
            ).json()
            for _ in range(2)
        ]
        yield Perimeter(rig, built, server, inspector, opened[0], opened[1])
    finally:

        async def stop() -> None:
            await inspector.stop()
            await server.stop()
            await context.__aexit__(None, None, None)

        rig.host.run(stop())
        rig.close()


def test_the_perimeter_holds_what_a_run_mints(tmp_path: Path) -> None:
    """The suite attacks workers that hold every role's credential, as ``tokentrail run``'s
    do: the client key among them, so plain generation without capture is refused to an
    agent (its key is good only on the gateway) on the run's worker too."""
    assert set(Credentials.mint(tmp_path / "credentials").tokens) == set(CREDENTIALS.tokens)


def test_every_route_states_its_roles(perimeter: Perimeter) -> None:
    assert unguarded_routes(perimeter.built.app, gateway_policy()) == []
    assert unguarded_routes(perimeter.rig.server._config.app, worker_policy()) == []  # type: ignore[arg-type]
    assert unguarded_routes(perimeter.inspector._config.app, inspect_policy()) == []  # type: ignore[arg-type]


def test_the_agent_calls_its_own_rollout_and_nothing_else(
    perimeter: Perimeter, escape_report: EscapeReport
) -> None:
    mine = perimeter.mine
    agent = openai.OpenAI(base_url=mine["base_url"], api_key=mine["api_key"], max_retries=0, timeout=120)
    reply = agent.chat.completions.create(**CHAT)  # type: ignore[call-overload]
    assert reply.choices[0].message is not None
    for _ in agent.chat.completions.create(**CHAT, stream=True):  # type: ignore[call-overload]
        pass
    before = perimeter.state()
    attempts = list(_attacks(perimeter))
    refused: dict[int, int] = {}
    for surface, route, name, method, url, headers, body in attempts:
        response = httpx.request(method, url, json=body, headers=headers, timeout=60)
        assert response.status_code in (401, 403, 404), (
            f"{name}: {response.status_code} {response.text[:200]}"
        )
        assert mine["api_key"] not in response.text, f"{name}: the credential was echoed"
        refused[response.status_code] = refused.get(response.status_code, 0) + 1
        escape_report.record(surface, route, method, response.status_code)
    escape_report.unchanged = perimeter.state() == before
    assert escape_report.unchanged, "an attack changed something"
    print(f"\nescape suite: {len(attempts)} attacks tried, all refused {refused}, nothing changed")
    assert len(attempts) > 40


def _attacks(p: Perimeter) -> Iterator[tuple[str, str, str, str, str, dict[str, str], Any]]:
    """(surface, route, name, method, url, headers, body) of every attack."""
    mine, other = p.mine, p.other
    keys = {
        "bearer": {"authorization": f"Bearer {mine['api_key']}"},
        "x-api-key": {"x-api-key": mine["api_key"]},
        "forged": {"authorization": f"Bearer tta_{secrets.token_urlsafe(32)}"},
        "none": {},
    }
    admission = p.rig.client.admit(mine["rollout_id"], None).model_dump(mode="json")
    for surface, app, base, policy in (
        ("gateway", p.built.app, p.url, gateway_policy()),
        ("worker", p.rig.server._config.app, p.rig.url, worker_policy()),  # type: ignore[attr-defined]
        ("inspector", p.inspector._config.app, p.inspector.url, inspect_policy()),  # type: ignore[attr-defined]
    ):
        for route in app.routes:
            if not isinstance(route, APIRoute) or policy[route.path].public:
                continue
            for method in sorted(route.methods - {"HEAD"}):
                for target in (mine, other):
                    path = re.sub(r"\{[a-z_]+\}", target["rollout_id"], route.path)
                    own = target is mine and Role.AGENT in policy[route.path].roles
                    for how, headers in keys.items():
                        if own and how in ("bearer", "x-api-key"):
                            continue  # its own model calls: allowed, tested above
                        body = {**CHAT, CAPTURE_FIELD: admission, "reward": 1.0, "path": "/", "version": 99}
                        name = f"{how} {method} {path}"
                        yield surface, route.path, name, method, f"{base}{path}", headers, body


def test_wrong_roles_and_a_sealed_rollout_are_refused(perimeter: Perimeter) -> None:
    p = perimeter
    before = p.state()
    seal_mine = f"{p.url}/rollouts/{p.mine['rollout_id']}/seal"
    assert p.as_role(Role.SERVICE, "POST", seal_mine, {"reward": 1.0}).status_code == 403
    assert p.as_role(Role.CLIENT, "POST", seal_mine, {"reward": 1.0}).status_code == 403
    assert p.as_role(Role.ENVIRONMENT, "POST", f"{p.rig.url}/admin/pause").status_code == 403
    assert p.as_role(Role.SERVICE, "POST", f"{p.rig.url}/pause").status_code == 403
    capture = {**CHAT, CAPTURE_FIELD: p.rig.client.admit("r-direct", None).model_dump(mode="json")}
    refused = p.as_role(Role.CLIENT, "POST", f"{p.rig.url}/v1/chat/completions", capture)
    assert refused.status_code == 403 and refused.json()["error"]["param"] == CAPTURE_FIELD, refused.text
    assert p.state() == before

    # Reward authority: the environment seals, and the seal names it (never its secret).
    opened = p.as_role(Role.ENVIRONMENT, "POST", f"{p.url}/rollouts", {}).json()
    sealed = p.as_role(
        Role.ENVIRONMENT, "POST", f"{p.url}/rollouts/{opened['rollout_id']}/seal", {"reward": 0.5}
    )
    assert sealed.status_code == 200 and sealed.json()["sealed_by"].startswith("environment:"), sealed.text
    assert CREDENTIALS.token(Role.ENVIRONMENT) not in sealed.text
    agent = openai.OpenAI(base_url=opened["base_url"], api_key=opened["api_key"], max_retries=0, timeout=60)
    with pytest.raises(openai.ConflictError):  # the key died with the seal
        agent.chat.completions.create(**CHAT)  # type: ignore[call-overload]
    paced = p.as_role(Role.ENVIRONMENT, "POST", f"{p.url}/rollouts", {})  # the pacer is full now
    assert paced.status_code == 429 and paced.headers["Retry-After"] == "1", paced.text
    agents_try = httpx.post(
        f"{p.url}/rollouts", json={}, headers={"authorization": f"Bearer {p.mine['api_key']}"}
    )
    assert agents_try.status_code == 401, agents_try.text  # the gate answers before pacing

    metrics = httpx.get(f"{p.url}/metrics").text + httpx.get(f"{p.rig.url}/metrics").text
    assert "tokentrail_auth_refusals_total" in metrics and "tokentrail_control_actions_total" in metrics
    for secret in [*CREDENTIALS.tokens.values(), p.mine["api_key"]]:
        assert secret not in metrics
