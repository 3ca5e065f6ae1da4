"""Paced generation as both trainers use it (``pipeline.run.paced``): rollouts held by the
feed's policy version and woken by ``advance``, a failed generation failing the step that
waits beside it, and leaving cancelling what still plays."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from pipeline.kafka.config import KafkaConfig
from pipeline.run.paced import PacedGeneration, advance
from pipeline.trainer.feed import FeedSettings, TrainerFeed
from stages.memory import MemoryDataPlane

Pace = Callable[[int], Awaitable[None]]


def unstarted_feed() -> TrainerFeed:
    """A feed whose policy version and metrics the gate reads; it never connects."""
    return TrainerFeed(KafkaConfig(), MemoryDataPlane(), FeedSettings(group_size=2))


def test_rollouts_run_ahead_by_max_staleness_steps_and_advance_wakes_the_held() -> None:
    async def go() -> tuple[list[tuple[int, int]], int]:
        feed = unstarted_feed()
        started: list[tuple[int, int]] = []  # (rollout index, policy version it started at)

        async def play(pace: Pace) -> None:
            for index in range(6):
                await pace(index)
                started.append((index, feed.policy_version))

        async with PacedGeneration(feed, play, max_staleness=1, rollouts_per_step=2) as generation:
            await asyncio.sleep(0.05)
            assert [index for index, _ in started] == [0, 1, 2, 3]  # steps 1 and 2: one version ahead
            await advance(feed, generation, 1)
            await asyncio.sleep(0.05)
            assert len(started) == 6
            await generation.finished()
        return started, generation.gate.waits

    started, waits = asyncio.run(go())
    assert [version for _, version in started] == [0, 0, 0, 0, 1, 1]
    assert waits == 1  # the fifth rollout waited; the sixth found the version moved


def test_a_failed_generation_fails_the_step_waiting_beside_it() -> None:
    async def go() -> bool:
        feed = unstarted_feed()
        step_waiting = asyncio.Event()
        never = asyncio.Event()

        async def play(pace: Pace) -> None:
            await pace(0)
            await step_waiting.wait()
            raise RuntimeError("the worker went away")

        async def step() -> None:
            step_waiting.set()
            await never.wait()

        async with PacedGeneration(feed, play, max_staleness=0, rollouts_per_step=1) as generation:
            taking = asyncio.ensure_future(step())
            with pytest.raises(RuntimeError, match="worker went away"):
                await generation.beside(taking)
        return taking.cancelled()

    assert asyncio.run(go())


def test_leaving_cancels_the_rollouts_still_playing_and_keeps_the_step_s_error() -> None:
    async def go() -> asyncio.Task[None]:
        feed = unstarted_feed()
        playing: list[asyncio.Task[None]] = []

        async def play(pace: Pace) -> None:
            task = asyncio.current_task()
            assert task is not None
            playing.append(task)
            for index in range(4):
                await pace(index)  # held from the second rollout: nothing advances

        async def step() -> None:
            raise TimeoutError("step 1: its rollouts were not finalized")

        with pytest.raises(TimeoutError, match="step 1"):
            async with PacedGeneration(feed, play, max_staleness=0, rollouts_per_step=1) as generation:
                await generation.beside(step())
        return playing[0]

    assert asyncio.run(go()).cancelled()


def test_a_generation_not_entered_is_refused() -> None:
    async def go() -> None:
        async def play(pace: Pace) -> None:
            await pace(0)

        generation = PacedGeneration(unstarted_feed(), play, max_staleness=0, rollouts_per_step=1)
        await generation.finished()

    with pytest.raises(RuntimeError, match="async with"):
        asyncio.run(go())
