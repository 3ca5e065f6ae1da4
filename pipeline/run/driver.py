"""Playing a run's rollouts so that an interruption still gives every started rollout an outcome.

``RolloutDriver.play_all`` is fine when it runs to the end. When a run is stopped
(Ctrl-C, SIGTERM, a failed component) the in-flight episodes are cancelled, and a
cancelled episode never reaches its seal: the ledger would hold it open until
``max_open_s`` and no ``FinalizedEvent`` would follow for a long time. Here each
cancelled rollout that had not begun sealing is sealed as failed
(``interrupted``), so the next run's stages reject it promptly; rollouts that never
started are never admitted and need nothing. With a ``RunJournal`` every start and every
acknowledged seal is journaled, so that a run killed outright is finished by the next
(``pipeline.run.journal``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from pipeline.run.journal import INTERRUPTED, RunJournal
from stages.client import RolloutClient
from stages.driver import DriverStats, Job
from stages.envs.arithmetic import Episode
from stages.ports import EventSink
from topics.records import RolloutSeal

log = logging.getLogger(__name__)


class SealTrackingClient(RolloutClient):
    """A ``RolloutClient`` that remembers which rollouts began sealing (one seal each), and
    journals each seal once the broker acknowledged it."""

    def __init__(self, sink: EventSink, journal: RunJournal | None = None) -> None:
        super().__init__(sink)
        self.journal = journal
        self.sealing: set[str] = set()

    async def seal(self, rollout_id: str, **options: Any) -> RolloutSeal:
        self.sealing.add(rollout_id)
        seal = await super().seal(rollout_id, **options)
        if self.journal is not None:
            self.journal.sealed(rollout_id)
        return seal


class Player(Protocol):
    """Plays one job to its seal: the built-in driver, or an SDK agent through the gateway."""

    stats: DriverStats

    async def play(self, job: Job) -> Episode: ...


async def play_jobs(
    driver: Player,
    client: SealTrackingClient,
    jobs: Sequence[Job],
    concurrency: int,
    *,
    seal_timeout_s: float = 5.0,
    pace: Callable[[int], Awaitable[None]] | None = None,
) -> None:
    """Play every job, at most ``concurrency`` at once; on cancellation seal the in-flight ones.

    ``pace(index)`` is awaited before the ``index``-th job starts (the trainer's pacing):
    a job held there is not admitted yet, so a stop then needs no seal."""
    gate = asyncio.Semaphore(concurrency)

    async def one(index: int, job: Job) -> None:
        if pace is not None:
            await pace(index)
        async with gate:
            if client.journal is not None:
                client.journal.started(job)
            try:
                await driver.play(job)
            except asyncio.CancelledError:
                if job.rollout_id not in client.sealing:
                    try:
                        await asyncio.wait_for(
                            client.seal(job.rollout_id, group_id=job.group_id, failed=INTERRUPTED),
                            seal_timeout_s,
                        )
                    except Exception as exc:
                        log.warning("could not seal interrupted rollout %s: %s", job.rollout_id, exc)
                raise

    await asyncio.gather(*(one(index, job) for index, job in enumerate(jobs)))
