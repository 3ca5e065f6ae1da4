"""Who plays a run's rollouts: the built-in driver against the worker, or an agent that
only uses the openai SDK through a gateway (which builds the admissions then)."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from pipeline.auth.credentials import Credentials, Role
from pipeline.run.cluster import Services
from pipeline.run.config import RunConfig
from pipeline.run.driver import Player, SealTrackingClient, play_jobs
from pipeline.run.sdk_agent import SdkAgent
from stages.driver import Job, RolloutDriver


@dataclass(frozen=True, slots=True)
class Scenario:
    """The run's player, and how many of its rollouts are in flight at once."""

    player: Player
    client: SealTrackingClient
    """Seals what the player admitted; a stop seals the rollouts in flight as interrupted."""
    concurrency: int
    against: str | None
    """Where the rollouts are played: the gateway's or the worker's URL."""

    async def play(
        self, jobs: Sequence[Job], *, pace: Callable[[int], Awaitable[None]] | None = None
    ) -> None:
        await play_jobs(self.player, self.client, jobs, self.concurrency, pace=pace)


async def open_scenario(
    stack: contextlib.AsyncExitStack, config: RunConfig, services: Services, credentials: Credentials
) -> Scenario:
    """The SDK agent where the services have a gateway, else the built-in driver."""
    client = services.outcomes.seals
    player: Player
    if services.gateway_url is not None:
        agent = SdkAgent(
            services.gateway_url,
            services.served_model,
            sampling=config.sampling,
            max_tokens=config.max_tokens,
            max_turns=config.turns,
            seed=config.seed,
            headers=credentials.authorization(Role.ENVIRONMENT),
        )
        stack.push_async_callback(agent.aclose)
        player = agent
    else:
        assert services.endpoint is not None, "services without a gateway have the worker's endpoint"
        player = RolloutDriver(
            client,
            services.endpoint,
            sampling=config.sampling,
            max_tokens=config.max_tokens,
            max_turns=config.turns,
            seed=config.seed,
        )
    against = services.gateway_url or services.worker_url
    return Scenario(player=player, client=client, concurrency=config.concurrency, against=against)
