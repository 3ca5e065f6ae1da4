"""A rollout driver: plays environment episodes against a worker's chat endpoint.

It is the client side of capture in action: every turn is admitted (published, and
sent along as ``ng_capture``), the reply's ``ng_commit_coords`` anchor the next turn,
and the rollout is sealed with its reward when the episode ends, or sealed as failed
when the endpoint breaks, so every admitted rollout still reaches one outcome.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from stages.client import RolloutClient
from stages.envs.arithmetic import CALCULATOR_TOOL, Episode, Task
from topics.records import CommitCoords

log = logging.getLogger(__name__)


class ChatEndpoint(Protocol):
    """An OpenAI-compatible chat completion call (the worker's HTTP endpoint)."""

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]: ...


@dataclass(slots=True)
class DriverStats:
    admitted: int = 0
    sealed: int = 0
    calls: int = 0
    capture_failed: int = 0
    broken: int = 0
    paced: int = 0
    """Times a rollout was held back before it started (a paced gateway's 429)."""


@dataclass(frozen=True, slots=True)
class Job:
    rollout_id: str
    task: Task
    group_id: str


class RolloutDriver:
    """Runs episodes concurrently; ``stats`` counts what it did."""

    def __init__(
        self,
        client: RolloutClient,
        endpoint: ChatEndpoint,
        *,
        sampling: Mapping[str, Any] | None = None,
        max_tokens: int = 48,
        max_turns: int = 3,
        seed: int | None = None,
    ) -> None:
        """``sampling``: the options every call sends (temperature, top-p, ...); default temperature 1."""
        self.client = client
        self.endpoint = endpoint
        self.sampling = dict(sampling or {"temperature": 1.0})
        self.max_tokens = max_tokens
        self.max_turns = max_turns
        self.seed = seed
        self.stats = DriverStats()

    async def play(self, job: Job) -> Episode:
        episode = Episode(job.task, self.max_turns)
        parent: CommitCoords | None = None
        self.stats.admitted += 1
        try:
            while not episode.done:
                admission = self.client.admit(job.rollout_id, parent, group_id=job.group_id)
                body = self.client.request_body(self._body(episode, job), admission)
                _, reply = await asyncio.gather(
                    self.client.publish_admission(admission), self.endpoint.chat(body)
                )
                self.stats.calls += 1
                parent = self.client.coords_from_reply(reply)
                if parent is None or parent.disposition != "staged":
                    self.stats.capture_failed += 1
                episode.step(reply["choices"][0]["message"])
        except Exception as exc:  # the endpoint broke: the rollout still gets its outcome
            self.stats.broken += 1
            log.warning("rollout %s broke: %s", job.rollout_id, exc)
            await self.client.seal(job.rollout_id, group_id=job.group_id, failed=f"driver: {exc}"[:200])
            self.stats.sealed += 1
            return episode
        await self.client.seal(job.rollout_id, group_id=job.group_id, reward=episode.reward())
        self.stats.sealed += 1
        return episode

    async def play_all(self, jobs: Sequence[Job], concurrency: int) -> list[Episode]:
        gate = asyncio.Semaphore(concurrency)

        async def one(job: Job) -> Episode:
            async with gate:
                return await self.play(job)

        return list(await asyncio.gather(*(one(job) for job in jobs)))

    def _body(self, episode: Episode, job: Job) -> dict[str, Any]:
        body: dict[str, Any] = {
            "messages": episode.messages,
            "tools": [CALCULATOR_TOOL],
            **self.sampling,
            "max_tokens": self.max_tokens,
        }
        if self.seed is not None:
            body["seed"] = episode_seed(self.seed, job.rollout_id, episode.turns)
        return body


def episode_seed(seed: int, rollout_id: str, turn: int) -> int:
    """A sampling seed per rollout and turn: runs repeat, rollouts of one group differ."""
    return seed + zlib.crc32(rollout_id.encode()) % 10_000 + turn


__all__ = ["ChatEndpoint", "DriverStats", "Job", "RolloutDriver", "episode_seed"]
