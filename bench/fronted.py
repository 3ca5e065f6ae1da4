"""A real worker with gateways in front of it: the cluster ``bench.quotas`` and
``bench.gateway_soak`` drive through the gateway as an agent would.

One ``tokentrail worker`` (vLLM CPU engine, the tiny model, credentials on), an embedded
broker with the topics, a ``tokentrail dataplane``; gateways are started on demand, each a
``tokentrail gateway`` in front of that worker. The environment's credential opens and
seals rollouts; each agent holds only its rollout's ``api_key``, as the gateway hands it out.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.common import started
from pipeline.auth.credentials import Credentials, Role
from pipeline.gateway.settings import GatewaySettings
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.embedded.broker import EmbeddedBroker
from pipeline.process.flags import to_argv
from pipeline.worker.settings import WorkerSettings

CLI = [sys.executable, "-m", "pipeline.cli"]


@dataclass(slots=True)
class Fronted:
    """The running services; ``gateway`` starts one more gateway in front of the worker."""

    root: Path
    stack: ExitStack
    common: list[str]
    """The flags every verb of the cluster shares: broker, credentials, ``--json``."""
    environment: dict[str, str]
    """The environment's authorization header: it opens and seals rollouts."""
    model: str
    worker: subprocess.Popen[bytes]
    worker_url: str
    dataplane: subprocess.Popen[bytes]
    gateways: int = 0
    """Gateways started so far: each logs to ``root/gateway-N.log``."""

    def gateway(self, **settings: Any) -> tuple[subprocess.Popen[bytes], str]:
        """A ``tokentrail gateway`` with ``settings`` (the rest at their defaults), and its URL;
        it stops with the cluster."""
        fronting = GatewaySettings(workers=self.worker_url, port=0, **settings)
        argv = [*CLI, "gateway", *to_argv(fronting), *self.common]
        log = self.root / f"gateway-{self.gateways}.log"
        self.gateways += 1
        process, ready = self.stack.enter_context(started(argv, log))
        return process, ready["url"]


@contextmanager
def fronted(root: Path) -> Iterator[Fronted]:
    """Broker, data plane and worker, their state and logs under ``root``; all stop on exit."""
    with EmbeddedBroker() as broker, ExitStack() as stack:
        asyncio.run(ensure_topics(broker.kafka_config()))
        secrets_dir = root / "credentials"
        environment = Credentials.mint(secrets_dir).authorization(Role.ENVIRONMENT)
        model_dir = root / "model"
        subprocess.run([*CLI, "make-tiny-model", str(model_dir)], check=True, stdout=subprocess.DEVNULL)
        common = ["--bootstrap", broker.bootstrap, "--credentials-dir", str(secrets_dir), "--json"]
        dataplane, _ = stack.enter_context(
            started([*CLI, "dataplane", "--data-dir", str(root), "--json"], root / "dataplane.log")
        )
        capture = WorkerSettings(model_dir=model_dir, port=0, dataplane_addresses=root / "dataplane.json")
        worker, ready = stack.enter_context(
            started([*CLI, "worker", *to_argv(capture), *common], root / "worker.log")
        )
        yield Fronted(root, stack, common, environment, ready["model"], worker, ready["url"], dataplane)


async def open_rollout(http: httpx.AsyncClient) -> dict[str, Any]:
    """``POST /rollouts`` with the environment's credential: the agent's base URL and key."""
    opened: dict[str, Any] = (await http.post("/rollouts", json={})).raise_for_status().json()
    return opened


async def seal(http: httpx.AsyncClient, opened: dict[str, Any], reward: float = 0.0) -> None:
    """Seal a rollout opened with ``open_rollout``."""
    (await http.post(f"/rollouts/{opened['rollout_id']}/seal", json={"reward": reward})).raise_for_status()


__all__ = ["Fronted", "fronted", "open_rollout", "seal"]
