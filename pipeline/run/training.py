"""``tokentrail run --train-steps N``: the closed RL loop on the tiny model.

Each step plays the run's ``--rollouts`` rollouts against the worker, takes their
groups from the trainer feed (its own consumer group on ``tokentrail.finalized``) as
one batch, takes one GRPO step on the trainer's copy of the weights, saves them, and
refits the worker through its admin endpoints (pause, reload, set the version, resume),
so the next step's rollouts carry the next weight version. Only then is the batch
acknowledged: its samples leave the data plane and the feed commits past them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from pipeline.trainer.feed import TrainerFeed
from pipeline.trainer.grpo import GrpoTrainer
from stages.trainer.batch import TrainBatch

log = logging.getLogger(__name__)

WEIGHTS_DIR = "weights"
"""Under the data directory: one checkpoint per step, ``step-{k}``."""


@dataclass(frozen=True, slots=True)
class TrainStep:
    step: int
    weight_version: int
    """The weight version the step's rollouts were sampled with."""
    samples: int
    reward_mean: float | None
    ratio_max_abs_dev: float
    loss: float
    update_norm: float
    policy_shift: float
    seconds: dict[str, float]
    """Where the step's time went: ``rollout`` (playing its rollouts), ``wait`` (until they
    were finalized and archived), ``optimizer`` (the GRPO step and saving), ``refit``."""

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


class ClosedLoop:
    """Steps ``play`` → feed batch → GRPO step → refit, recording each step."""

    def __init__(
        self,
        feed: TrainerFeed,
        trainer: GrpoTrainer,
        worker_url: str,
        data_dir: Path,
        *,
        batch_timeout_s: float,
        operator_headers: Mapping[str, str] | None = None,
    ) -> None:
        self.feed = feed
        self.batch_timeout_s = batch_timeout_s
        self.trainer = trainer
        self.worker_url = worker_url
        self.operator_headers = dict(operator_headers or {})
        self.weights_dir = data_dir / WEIGHTS_DIR
        self.steps: list[TrainStep] = []

    async def run_step(
        self,
        step: int,
        play: Callable[[], Awaitable[None]],
        archived: Callable[[TrainBatch], Awaitable[None]],
    ) -> TrainStep:
        """One step; ``archived`` returns once the run's archive holds the batch's samples."""
        version = self.feed.policy_version
        marks = [time.monotonic()]
        await play()
        marks.append(time.monotonic())
        try:
            batch = await asyncio.wait_for(self.feed.next_batch(), self.batch_timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"step {step}: its rollouts were not finalized within {self.batch_timeout_s:.0f}s"
            ) from None
        await archived(batch)
        marks.append(time.monotonic())
        report = await asyncio.to_thread(self.trainer.step, batch)
        path = await asyncio.to_thread(self.trainer.save, self.weights_dir / f"step-{step}")
        marks.append(time.monotonic())
        await refit(self.worker_url, path, version=step, headers=self.operator_headers)
        marks.append(time.monotonic())
        spans = zip(("rollout", "wait", "optimizer", "refit"), itertools.pairwise(marks), strict=True)
        self.feed.policy_version = step
        await self.feed.ack(batch)
        record = TrainStep(
            step=step,
            weight_version=version,
            samples=len(batch),
            reward_mean=_mean([s.reward for s in batch.samples]),
            ratio_max_abs_dev=report.ratio_max_abs_dev,
            loss=report.loss,
            update_norm=report.update_norm,
            policy_shift=report.policy_shift,
            seconds={name: round(end - start, 3) for name, (start, end) in spans},
        )
        log.info(
            "train step %d: %d samples of weight version %d, reward mean %s, ratio deviation %.2e",
            step,
            record.samples,
            version,
            record.reward_mean,
            record.ratio_max_abs_dev,
        )
        self.steps.append(record)
        return record


async def refit(
    worker_url: str,
    path: Path,
    *,
    version: int,
    timeout_s: float = 300.0,
    headers: Mapping[str, str] | None = None,
) -> None:
    """Load ``path`` into the worker's engine and stamp ``version`` on what it generates next;
    ``headers`` carry the operator's credential."""
    async with httpx.AsyncClient(
        base_url=worker_url, timeout=timeout_s, trust_env=False, headers=dict(headers or {})
    ) as http:
        for route, body in (
            ("/admin/pause", None),
            ("/admin/reload_weights", {"path": str(path)}),
            ("/admin/weight_version", {"version": version}),
            ("/admin/resume", None),
        ):
            response = await http.post(route, json=body)
            if response.status_code != 200:
                raise RuntimeError(f"refit: {route} answered {response.status_code}: {response.text[:300]}")


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None and not math.isnan(v)]
    return sum(known) / len(known) if known else None
