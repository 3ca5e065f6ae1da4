"""A gateway in front of a test worker (``enginekit``), with credentials on, on a real socket.

The environment's calls carry its token; an agent gets only the base URL and key its
rollout session hands out, as an unmodified agent would.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import openai
from enginekit import Rig

from pipeline.auth.credentials import Credentials, Role
from pipeline.gateway.main import Gateway, GatewayConfig, gateway
from pipeline.worker.main import WorkerServer
from topics.records import FinalizedEvent, TrainingSample
from topics.wire import COORDS_FIELD

Played = TypeVar("Played")

CREDENTIALS = Credentials(
    {role: secrets.token_urlsafe(32) for role in (Role.ENVIRONMENT, Role.OPERATOR)},
    agent_key=secrets.token_bytes(32),
)
ENVIRONMENT = CREDENTIALS.authorization(Role.ENVIRONMENT)


@dataclass
class Served:
    """A gateway with credentials on: the environment's calls carry its token, agents their key."""

    rig: Rig
    built: Gateway
    server: WorkerServer

    @property
    def url(self) -> str:
        return self.server.url

    def session(self, **body: Any) -> dict[str, Any]:
        response = httpx.post(f"{self.url}/rollouts", json=body, timeout=10, headers=ENVIRONMENT)
        assert response.status_code == 200, response.text
        opened: dict[str, Any] = response.json()
        return opened

    def seal(self, rollout_id: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(
            f"{self.url}/rollouts/{rollout_id}/seal", json=body, timeout=10, headers=ENVIRONMENT
        )

    def show(self, rollout_id: str) -> dict[str, Any]:
        shown: dict[str, Any] = httpx.get(
            f"{self.url}/rollouts/{rollout_id}", timeout=10, headers=ENVIRONMENT
        ).json()
        return shown

    def worker_models(self) -> list[str]:
        """What the worker itself serves, asked directly."""
        return [m["id"] for m in httpx.get(f"{self.rig.url}/v1/models", timeout=10).json()["data"]]

    def calls(self, rollout_id: str) -> list[dict[str, Any]]:
        calls: list[dict[str, Any]] = self.show(rollout_id)["calls"]
        return calls


def agent_of(opened: dict[str, Any], **options: Any) -> openai.OpenAI:
    """The official SDK with exactly what the gateway handed out: a base URL and a key."""
    return openai.OpenAI(
        base_url=opened["base_url"], api_key=opened["api_key"], max_retries=0, timeout=120, **options
    )


def serve_gateway(rig: Rig, **config: Any) -> Iterator[Served]:
    settings: dict[str, Any] = {"workers": (rig.url,), "credentials": CREDENTIALS, **config}

    async def start() -> tuple[Any, Gateway, WorkerServer]:
        context = gateway(GatewayConfig(port=0, **settings), rig.driver_sink)
        built = await context.__aenter__()
        server = WorkerServer(built.app, host="127.0.0.1", port=0, graceful_timeout_s=5)
        await server.start()
        return context, built, server

    async def stop(context: Any, server: WorkerServer) -> None:
        await server.stop()
        await context.__aexit__(None, None, None)

    context, built, server = rig.host.run(start())
    try:
        yield Served(rig, built, server)
    finally:
        rig.host.run(stop(context, server))


def clean(extra: dict[str, Any] | None) -> None:
    """Nothing of the capture reached the agent."""
    assert not extra or COORDS_FIELD not in extra, extra


def sealed_session(
    rig: Rig, agent: Callable[[dict[str, Any]], Played], *, one_chain: bool = True, **session: Any
) -> tuple[Played, FinalizedEvent, TrainingSample | None]:
    """One rollout through a gateway: a session opened (``session``: its body), ``agent``
    given only what it hands out, the calls checked to form one chain (``one_chain``), the
    session sealed with reward 1 by the environment, then the ledger and the finalizer run.
    Returns what the agent returned, the outcome and the rollout's first sample."""
    with contextlib.contextmanager(serve_gateway)(rig) as served:
        opened = served.session(**session)
        played = agent(opened)
        calls = served.calls(opened["rollout_id"])
        if one_chain:
            assert [c["parent_call_id"] for c in calls] == [None, *(c["call_id"] for c in calls[:-1])]
        assert served.seal(opened["rollout_id"], {"reward": 1.0}).status_code == 200
        event, sample = rig.finalize(opened["rollout_id"], sealed=True)
    return played, event, sample
