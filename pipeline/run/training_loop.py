"""Who trains on a run's rollouts (``--train-steps``): the built-in GRPO step, or TRL's
``GRPOTrainer``; either refits the run's worker after every step.

Built once the services and the players exist: the trainer feed (its own consumer group
on ``tokentrail.finalized``, this run's rollouts only) and the trainer's copy of the
weights. ``train`` plays the run's rollouts step by step through the scenario; with
``--max-staleness K`` both trainers pace alike (``pipeline.run.paced``): every step's
rollouts play all along, at most ``K`` versions ahead, and each step trains its own groups.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from pipeline.auth.credentials import Role
from pipeline.run.cluster import RunContext, Services
from pipeline.run.paced import PacedGeneration, advance
from pipeline.run.scenario import Scenario
from pipeline.run.training import WEIGHTS_DIR, ClosedLoop, refit
from pipeline.trainer.feed import FeedSettings, TrainerFeed
from pipeline.trainer.grpo import GrpoTrainer
from pipeline.trainer.steplog import StepWriter
from pipeline.trainer.trl import TrlBridge, prompt_key
from pipeline.trainer.trl import train as train_with_trl
from stages.driver import Job
from stages.trainer.batch import TrainBatch
from stages.trainer.staleness import StalenessPolicy

TRL_DIR = "trl"
"""Under the data directory: TRL's output directory (its logs; weights go to ``weights/``)."""


class TrainingLoop(Protocol):
    """Plays the run's rollouts step by step, training on each step's samples."""

    async def train(self) -> None: ...

    def steps(self) -> list[dict[str, Any]]:
        """Each step taken so far, as the run's JSON reports it."""
        ...

    def paced_waits(self) -> int | None:
        """Rollouts the pacing held back until the policy version allowed them; None: not paced."""
        ...


async def open_training(
    stack: contextlib.AsyncExitStack, run: RunContext, services: Services, scenario: Scenario, jobs: list[Job]
) -> TrainingLoop:
    """The trainer feed and the configured trainer, loaded."""
    config = run.config
    wanted = {job.rollout_id for job in jobs}
    settings = FeedSettings(
        group_size=config.group_size,
        groups_per_batch=config.rollouts // config.group_size,
        group_timeout_s=config.finalize_timeout_s,
        staleness=StalenessPolicy(max_staleness=config.max_staleness, measure=config.staleness_measure),
        shift_behaviour_temperature=config.shift_behaviour_temperature,
    )
    feed = TrainerFeed(
        services.kafka, services.plane, settings, only=lambda event: event.rollout_id in wanted
    )
    await stack.enter_async_context(feed)
    assert services.worker_url is not None, "a training run starts its own worker"
    if config.trainer == "trl":
        return TrlTraining(run, services, scenario, jobs, feed, services.worker_url)
    trainer = await asyncio.to_thread(
        GrpoTrainer, services.model_dir, learning_rate=config.learning_rate, dtype=config.trainer_dtype
    )
    loop = ClosedLoop(
        feed,
        trainer,
        services.worker_url,
        config.data_dir,
        batch_timeout_s=config.finalize_timeout_s,
        operator_headers=run.credentials.authorization(Role.OPERATOR),
        trainer_delay_s=config.trainer_delay_s,
        step_writer=StepWriter(config.data_dir, run.run_id, "builtin"),
    )
    return BuiltinTraining(run, services, scenario, jobs, loop)


class BuiltinTraining:
    """Each step's rollouts, then its GRPO step and refit; with ``--max-staleness``, every
    step's rollouts all along, paced, beside the steps."""

    def __init__(
        self, run: RunContext, services: Services, scenario: Scenario, jobs: list[Job], loop: ClosedLoop
    ) -> None:
        self.run = run
        self.services = services
        self.scenario = scenario
        self.jobs = jobs
        self.loop = loop

    async def _archived(self, batch: TrainBatch) -> None:
        await self.services.outcomes.archived(batch, self.run.config.finalize_timeout_s)

    async def train(self) -> None:
        config, scenario, jobs = self.run.config, self.scenario, self.jobs
        slots = [jobs[i : i + config.rollouts] for i in range(0, len(jobs), config.rollouts)]
        if config.max_staleness is None:
            for step, step_jobs in enumerate(slots, start=1):
                self.run.progress.enter(f"train step {step}/{config.train_steps}")

                async def play(step_jobs: list[Job] = step_jobs) -> None:
                    await scenario.play(step_jobs)

                await self.loop.run_step(step, play, self._archived)
            return
        self.run.progress.enter(f"training {config.train_steps} steps, paced")

        async def play_paced(pace: Callable[[int], Awaitable[None]]) -> None:
            await scenario.play(jobs, pace=pace)

        await self.loop.run_paced(
            [{job.group_id for job in step_jobs} for step_jobs in slots],
            play_paced,
            self._archived,
            max_staleness=config.max_staleness,
            rollouts_per_step=config.rollouts,
        )

    def steps(self) -> list[dict[str, Any]]:
        return [step.as_json() for step in self.loop.steps]

    def paced_waits(self) -> int | None:
        generation = self.loop.generation
        return generation.gate.waits if generation is not None else None


class TrlTraining:
    """TRL's GRPOTrainer asks for each step's groups by prompt; each is played (with
    ``--max-staleness``, already playing, paced, since TRL asks in the planned order),
    verified and archived, and TRL's weights refit the worker after every step."""

    def __init__(
        self,
        run: RunContext,
        services: Services,
        scenario: Scenario,
        jobs: list[Job],
        feed: TrainerFeed,
        worker_url: str,
    ) -> None:
        config = run.config
        self.run = run
        self.model_dir = services.model_dir
        size = config.group_size
        self.planned = [jobs[i : i + size] for i in range(0, len(jobs), size)]
        unplayed: dict[str, collections.deque[list[Job]]] = collections.defaultdict(collections.deque)
        for group in self.planned:
            unplayed[prompt_key(group[0].task.prompt())].append(group)
        operator = run.credentials.authorization(Role.OPERATOR)
        timeout_s = config.finalize_timeout_s
        self.generation: PacedGeneration | None = None
        if config.max_staleness is not None:

            async def play_paced(pace: Callable[[int], Awaitable[None]]) -> None:
                await scenario.play(jobs, pace=pace)

            self.generation = PacedGeneration(
                feed, play_paced, max_staleness=config.max_staleness, rollouts_per_step=config.rollouts
            )

        async def play(prompts: list[list[dict[str, Any]]]) -> list[str]:
            groups = [unplayed[prompt_key(prompt)].popleft() for prompt in prompts]
            run.progress.enter(f"train step {len(self.bridge.steps) + 1}/{config.train_steps}")
            if self.generation is None:
                await scenario.play([job for group in groups for job in group])
            return [group[0].group_id for group in groups]

        async def next_batch(group_ids: list[str]) -> TrainBatch:
            taking = feed.next_batch(group_ids)
            try:
                if self.generation is None:
                    batch = await asyncio.wait_for(taking, timeout_s)
                else:
                    batch = await self.generation.beside(asyncio.wait_for(taking, timeout_s))
            except TimeoutError:
                raise TimeoutError(f"rollouts not finalized within {timeout_s:.0f}s") from None
            await services.outcomes.archived(batch, timeout_s)
            return batch

        async def refit_to(path: Path, version: int) -> None:
            await refit(worker_url, path, version=version, headers=operator)
            await advance(feed, self.generation, version)

        self.bridge = TrlBridge(
            asyncio.get_running_loop(),
            play=play,
            next_batch=next_batch,
            refit=refit_to,
            ack=feed.ack,
            version=lambda: feed.policy_version,
            weights_dir=config.data_dir / WEIGHTS_DIR,
            step_writer=StepWriter(config.data_dir, run.run_id, "trl"),
        )

    async def train(self) -> None:
        if self.generation is None:
            await self._train()
            return
        self.run.progress.enter(f"training {self.run.config.train_steps} steps, paced")
        async with self.generation:
            await self._train()
            await self.generation.finished()

    async def _train(self) -> None:
        config = self.run.config
        await asyncio.to_thread(
            train_with_trl,
            self.bridge,
            self.model_dir,
            [group[0].task.prompt() for group in self.planned],
            group_size=config.group_size,
            groups_per_step=config.rollouts // config.group_size,
            steps=config.train_steps,
            learning_rate=config.learning_rate,
            output_dir=config.data_dir / TRL_DIR,
            seed=config.seed,
            dtype=config.trainer_dtype,
        )

    def steps(self) -> list[dict[str, Any]]:
        return [step.as_json() for step in self.bridge.steps]

    def paced_waits(self) -> int | None:
        return self.generation.gate.waits if self.generation is not None else None
