"""Paced generation (``--max-staleness K``), shared by both trainers: every step's rollouts
play in the background, the ``index``-th held until the feed's policy version admits it
(``stages.trainer.pacing``), while the trainer takes each step's own groups in admission
order and moves the policy version after each refit."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Self, TypeVar

from pipeline.trainer.feed import TrainerFeed
from stages.trainer.pacing import admissible

T = TypeVar("T")


class PacedGeneration:
    """``async with``: every step's rollouts play in the background, each held by a
    ``VersionGate``, while the trainer takes its steps in admission order; a failed
    generation fails the step waiting ``beside`` it, and leaving cancels what still plays.
    The built-in loop and TRL's bridge pace alike through it."""

    def __init__(
        self,
        feed: TrainerFeed,
        play: Callable[[Callable[[int], Awaitable[None]]], Coroutine[Any, Any, None]],
        *,
        max_staleness: int,
        rollouts_per_step: int,
    ) -> None:
        """``play(pace)`` plays every step's rollouts, awaiting ``pace(index)`` before the ``index``-th."""
        self.gate = VersionGate(feed, max_staleness=max_staleness, rollouts_per_step=rollouts_per_step)
        self._play = play
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self._play(self.gate.pace), name="paced-generation")
        return self

    async def __aexit__(self, *exc: object) -> None:
        task = self._running()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _running(self) -> asyncio.Task[None]:
        if self._task is None:
            raise RuntimeError("PacedGeneration is not started; use 'async with'")
        return self._task

    async def beside(self, work: Awaitable[T]) -> T:
        """``work``'s result, or the generation's error if it fails first (``work`` is cancelled)."""
        generation = self._running()
        taking = asyncio.ensure_future(work)
        await asyncio.wait({taking, generation}, return_when=asyncio.FIRST_COMPLETED)
        if generation.done() and (generation.cancelled() or generation.exception() is not None):
            taking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await taking
            generation.result()  # the rollouts failed: so does the step
        return await taking

    async def finished(self) -> None:
        """Every rollout played (raises the generation's error)."""
        await self._running()


class VersionGate:
    """Paced generation (``stages.trainer.pacing``): ``pace(index)`` returns once the
    ``index``-th rollout may start at the feed's policy version; ``advance`` wakes it."""

    def __init__(self, feed: TrainerFeed, *, max_staleness: int, rollouts_per_step: int) -> None:
        self.feed = feed
        self.max_staleness = max_staleness
        self.rollouts_per_step = rollouts_per_step
        self.waits = 0
        """Rollouts that waited for the policy version before they started."""
        self.advanced = asyncio.Condition()

    async def pace(self, index: int) -> None:
        def allowed() -> bool:
            return admissible(
                index,
                self.feed.policy_version,
                max_staleness=self.max_staleness,
                rollouts_per_step=self.rollouts_per_step,
            )

        if allowed():
            return
        self.waits += 1
        self.feed.metrics.paced.inc()
        async with self.advanced:
            await self.advanced.wait_for(allowed)


async def advance(feed: TrainerFeed, generation: PacedGeneration | None, version: int) -> None:
    """Move the feed's policy version (the workers serve ``version`` now), waking held rollouts."""
    if generation is None:
        feed.policy_version = version
        return
    async with generation.gate.advanced:
        feed.policy_version = version
        generation.gate.advanced.notify_all()
