"""``tokentrail run --train-steps N``: the closed RL loop on the tiny model.

Each step plays the run's ``--rollouts`` rollouts against the worker, takes their
groups from the trainer feed (its own consumer group on ``tokentrail.finalized``) as
one batch, takes one GRPO step on the trainer's copy of the weights, saves them, and
refits the worker through its admin endpoints (pause, reload, set the version, resume),
so the next step's rollouts carry the next weight version. Only then is the batch
acknowledged: its samples leave the data plane and the feed commits past them.

Paced (``--max-staleness K``): generation runs ahead of the trainer instead of waiting
for each step, held back by the pacer (``pipeline.run.paced``): the rollouts of step
``s`` start only once the worker serves version ``s - 1 - K`` or later, and step ``s``
trains exactly step ``s``'s groups, so none of its samples is more than ``K`` versions
behind the trainer and none is dropped for staleness.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Collection, Coroutine, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from pipeline.run.paced import PacedGeneration, advance
from pipeline.trainer.feed import TrainerFeed
from pipeline.trainer.grpo import GrpoTrainer
from pipeline.trainer.steplog import StepWriter
from stages.trainer.batch import TrainBatch

log = logging.getLogger(__name__)

WEIGHTS_DIR = "weights"
"""Under the data directory: one checkpoint per step, ``step-{k}``."""


@dataclass(frozen=True, slots=True)
class TrainStep:
    step: int
    weight_version: int
    """The trainer's policy version when it took the step: what the step's rollouts were
    sampled with in the synchronous loop; paced, they may be up to ``max_staleness`` older."""
    samples: int
    reward_mean: float | None
    ratio_max_abs_dev: float
    loss: float
    update_norm: float
    policy_shift: float
    seconds: dict[str, float]
    """Where the step's time went: ``rollout`` (playing its rollouts; not when paced, where
    they play all along), ``wait`` (until they were finalized and archived), ``optimizer``
    (the GRPO step and saving, and ``trainer_delay_s``), ``refit``."""
    staleness_max: int | None
    """The most versions any of the step's trained samples was behind, by the feed's measure."""
    stale_dropped: int
    """Samples the feed's staleness policy dropped from the step's batch."""
    mismatch: dict[str, Any] | None
    """The batch's training-inference mismatch before the step (``stages.trainer.mismatch``)."""

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


class ClosedLoop:
    """Steps ``play`` → feed batch → GRPO step → refit, recording each step; or, paced,
    generation all along and one step per step's groups."""

    def __init__(
        self,
        feed: TrainerFeed,
        trainer: GrpoTrainer,
        worker_url: str,
        data_dir: Path,
        *,
        batch_timeout_s: float,
        operator_headers: Mapping[str, str] | None = None,
        trainer_delay_s: float = 0.0,
        step_writer: StepWriter | None = None,
    ) -> None:
        """``trainer_delay_s``: sleep this long before each optimizer step (a slow trainer);
        ``step_writer``: where each step's report and logprobs are kept (the inspector's)."""
        self.step_writer = step_writer
        self.feed = feed
        self.batch_timeout_s = batch_timeout_s
        self.trainer = trainer
        self.worker_url = worker_url
        self.operator_headers = dict(operator_headers or {})
        self.weights_dir = data_dir / WEIGHTS_DIR
        self.trainer_delay_s = trainer_delay_s
        self.steps: list[TrainStep] = []
        self.generation: PacedGeneration | None = None
        """Paced: every step's rollouts, playing beside the steps."""

    async def run_step(
        self,
        step: int,
        play: Callable[[], Awaitable[None]],
        archived: Callable[[TrainBatch], Awaitable[None]],
    ) -> TrainStep:
        """One step; ``archived`` returns once the run's archive holds the batch's samples."""
        started = time.monotonic()
        await play()
        return await self._train(step, archived, {"rollout": time.monotonic() - started})

    async def run_paced(
        self,
        steps: Sequence[Collection[str]],
        play: Callable[[Callable[[int], Awaitable[None]]], Coroutine[Any, Any, None]],
        archived: Callable[[TrainBatch], Awaitable[None]],
        *,
        max_staleness: int,
        rollouts_per_step: int,
    ) -> None:
        """Train one step per entry of ``steps`` (each its groups' ids) while ``play`` plays
        every step's rollouts, awaiting ``pace(index)`` before the ``index``-th starts."""

        self.generation = generation = PacedGeneration(
            self.feed, play, max_staleness=max_staleness, rollouts_per_step=rollouts_per_step
        )
        async with generation:
            for step, groups in enumerate(steps, start=1):
                await generation.beside(self._train(step, archived, {}, groups=groups))
            await generation.finished()

    async def _train(
        self,
        step: int,
        archived: Callable[[TrainBatch], Awaitable[None]],
        seconds: dict[str, float],
        *,
        groups: Collection[str] | None = None,
    ) -> TrainStep:
        """Take the step's batch (``groups``, or the feed's next), train, refit, acknowledge."""
        version = self.feed.policy_version
        marks = [time.monotonic()]
        try:
            batch = await asyncio.wait_for(self.feed.next_batch(groups), self.batch_timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"step {step}: its rollouts were not finalized within {self.batch_timeout_s:.0f}s"
            ) from None
        await archived(batch)
        marks.append(time.monotonic())
        if self.trainer_delay_s:
            await asyncio.sleep(self.trainer_delay_s)
        report = await asyncio.to_thread(self.trainer.step, batch, policy_version=version)
        if self.step_writer is not None and report.mismatch is not None:
            await asyncio.to_thread(
                self.step_writer.write,
                step,
                version,
                report.mismatch,
                report.trainer_logprobs or {},
                reward_mean=_mean([s.reward for s in batch.samples]),
                trainer_metrics={
                    "loss": report.loss,
                    "update_norm": report.update_norm,
                    "policy_shift": report.policy_shift,
                    "clip_fraction": report.clip_fraction,
                },
            )
        path = await asyncio.to_thread(self.trainer.save, self.weights_dir / f"step-{step}")
        marks.append(time.monotonic())
        await refit(self.worker_url, path, version=step, headers=self.operator_headers)
        marks.append(time.monotonic())
        spans = zip(("wait", "optimizer", "refit"), itertools.pairwise(marks), strict=True)
        seconds.update({name: end - start for name, (start, end) in spans})
        await advance(self.feed, self.generation, step)  # the worker serves ``step`` now
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
            seconds={name: round(value, 3) for name, value in seconds.items()},
            staleness_max=int(batch.staleness.max()) if len(batch) else None,
            stale_dropped=len(batch.stale),
            mismatch=report.mismatch,
        )
        log.info(
            "train step %d: %d samples of weight version %d, reward mean %s, ratio deviation %.2e, "
            "staleness at most %s, %d dropped as stale",
            step,
            record.samples,
            version,
            record.reward_mean,
            record.ratio_max_abs_dev,
            record.staleness_max,
            record.stale_dropped,
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
