"""The built-in environment played by an agent that only knows the OpenAI SDK.

``tokentrail run --agent sdk`` drives its rollouts through the gateway with this agent:
plain ``openai`` calls on a session's base URL, the assistant message appended as the
SDK returns it, no admission, no coordinates. It shows (and tests) that an unmodified
agent is captured exactly; the gateway does the bookkeeping the built-in driver does.
A paced gateway answers the environment's ``POST /rollouts`` with 429 and ``Retry-After``
while the trainer is too far behind: the rollout waits that long and asks again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import httpx
import openai

from stages.driver import DriverStats, Job, episode_seed
from stages.envs.arithmetic import CALCULATOR_TOOL, Episode

log = logging.getLogger(__name__)


SDK_SAMPLING = frozenset({"temperature", "top_p"})
"""Sampling options the openai SDK's ``chat.completions.create`` takes as parameters."""


class SdkAgent:
    """Plays jobs through ``gateway_url``; ``stats`` counts what it did, like the driver's."""

    def __init__(
        self,
        gateway_url: str,
        model: str,
        *,
        sampling: Mapping[str, Any] | None = None,
        max_tokens: int = 48,
        max_turns: int = 3,
        seed: int | None = None,
        timeout_s: float = 120.0,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """``headers``: the environment's credential; the agent itself gets only its rollout's key."""
        self.gateway_url = gateway_url.rstrip("/")
        self.model = model
        self.sampling = dict(sampling or {"temperature": 1.0})
        self.max_tokens = max_tokens
        self.max_turns = max_turns
        self.seed = seed
        self.timeout_s = timeout_s
        self.stats = DriverStats()
        self._http = httpx.AsyncClient(timeout=timeout_s, trust_env=False, headers=dict(headers or {}))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def play(self, job: Job) -> Episode:
        episode = Episode(job.task, self.max_turns)
        opened = await self._open(job)
        self.stats.admitted += 1
        try:
            async with openai.AsyncOpenAI(
                base_url=opened["base_url"], api_key=opened["api_key"], max_retries=0, timeout=self.timeout_s
            ) as agent:
                while not episode.done:
                    reply = await agent.chat.completions.create(**self._request(episode, job))
                    self.stats.calls += 1
                    episode.step(reply.choices[0].message.model_dump(exclude_none=True))
        except Exception as exc:  # the call broke: the rollout still gets its outcome
            self.stats.broken += 1
            log.warning("rollout %s broke: %s", job.rollout_id, exc)
            await self._seal(job, {"status": "failed", "reason": f"agent: {exc}"[:200]})
            return episode
        await self._seal(job, {"reward": episode.reward()})
        return episode

    def _request(self, episode: Episode, job: Job) -> dict[str, Any]:
        request: dict[str, Any] = {
            "model": self.model,
            "messages": episode.messages,
            "tools": [CALCULATOR_TOOL],
            "max_tokens": self.max_tokens,
        }
        for name, value in self.sampling.items():  # the SDK has no top_k or min_p: vLLM's extras
            if name in SDK_SAMPLING:
                request[name] = value
            else:
                request.setdefault("extra_body", {})[name] = value
        if self.seed is not None:
            request["seed"] = episode_seed(self.seed, job.rollout_id, episode.turns)
        return request

    async def _open(self, job: Job) -> dict[str, Any]:
        """The rollout's session; while the gateway paces admissions, wait as it says."""
        body = {"rollout_id": job.rollout_id, "group_id": job.group_id}
        while True:
            response = await self._http.post(f"{self.gateway_url}/rollouts", json=body)
            if response.status_code != 429 or "retry-after" not in response.headers:
                response.raise_for_status()
                opened: dict[str, Any] = response.json()
                return opened
            self.stats.paced += 1
            await asyncio.sleep(_seconds(response.headers["retry-after"]))

    async def _seal(self, job: Job, body: dict[str, Any]) -> None:
        await self._post(f"/rollouts/{job.rollout_id}/seal", body)
        self.stats.sealed += 1

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await self._http.post(f"{self.gateway_url}{path}", json=body)
        response.raise_for_status()
        document: dict[str, Any] = response.json()
        return document


def _seconds(retry_after: str) -> float:
    """``Retry-After`` in seconds (the gateway sends whole seconds; 1 if it is unreadable)."""
    try:
        return min(60.0, max(0.0, float(retry_after)))
    except ValueError:
        return 1.0


__all__ = ["SdkAgent"]
