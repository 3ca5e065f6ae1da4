"""What a run reads back: its rollouts' finalized events, their archived samples, the lag.

Built once the event log and the data plane exist, before any rollout is played, so
that no outcome of this run is missed: the producer the players publish with (and the
journal of what they admitted), the follower of ``tokentrail.finalized``, the archiver
of accepted samples and the stages' lag probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.producer import KafkaEventSink
from pipeline.kafka.reader import topic_ends
from pipeline.run.archiver import SampleArchiver
from pipeline.run.driver import SealTrackingClient
from pipeline.run.finalized_watch import FinalizedWatcher
from pipeline.run.journal import RunJournal, close_dead_runs
from pipeline.run.report import RunProgress
from pipeline.run.shutdown import Shutdown, background
from pipeline.samples.archive import SampleArchive, archive_path
from pipeline.stagehost.lag import StageLagProbe
from stages.client import RolloutClient
from stages.ports import DataPlane
from stages.trainer.batch import TrainBatch

log = logging.getLogger(__name__)

LAG_POLL_S = 1.0


@dataclass(slots=True)
class Outcomes:
    """The run's producer and its view of the outcomes; ``archiving`` ends once every
    rollout of the run is finalized and its accepted samples archived."""

    sink: KafkaEventSink
    seals: SealTrackingClient
    """Publishes the players' admissions and seals, journaling what is still open."""
    watcher: FinalizedWatcher
    archiver: SampleArchiver
    archiving: asyncio.Task[None]
    probe: StageLagProbe
    closed_interrupted: int
    """Rollouts that killed runs on this data directory and log had left open, sealed now."""
    archived_expected: int = field(default=0)
    """Samples the training loop has waited to see archived so far."""

    async def archived(self, batch: TrainBatch, timeout_s: float) -> None:
        """Returns once the run's archive holds the batch's samples: none trains unarchived."""
        archiver = self.archiver
        self.archived_expected += sum(len(m.event.sample_keys) for g in batch.groups for m in g.members)
        deadline = time.monotonic() + timeout_s
        while archiver.written + len(archiver.failed) < self.archived_expected:
            if time.monotonic() > deadline:
                raise TimeoutError(f"samples not archived within {timeout_s:.0f}s")
            await asyncio.sleep(0.05)


async def follow_outcomes(
    stack: contextlib.AsyncExitStack,
    *,
    kafka: KafkaConfig,
    plane: DataPlane,
    log_identity: str,
    data_dir: Path,
    run_id: str,
    rollout_ids: list[str],
    progress: RunProgress,
    shutdown: Shutdown,
) -> Outcomes:
    """The producer, the lag probe, the journal, and the follower and archiver of this
    run's finalized events, each stopped when ``stack`` unwinds."""
    sink = await stack.enter_async_context(KafkaEventSink(kafka))
    probe = await stack.enter_async_context(StageLagProbe(kafka))
    closed = await close_dead_runs(data_dir, log_identity, RolloutClient(sink))
    journal = RunJournal(data_dir, run_id, log_identity)
    stack.callback(journal.close)
    archive = stack.enter_context(SampleArchive(archive_path(data_dir)))
    watcher = FinalizedWatcher(kafka, rollout_ids, on_event=progress.record)
    archiver = SampleArchiver(
        plane, archive, run_id, on_written=lambda n: setattr(progress, "samples_written", n)
    )
    start = await topic_ends(kafka, kafka.names.finalized)
    background(stack, watcher.follow(start), "finalized-follower", shutdown)
    archiving = background(stack, archiver.run(watcher.stream), "sample-archiver", shutdown)
    background(stack, _poll_lag(probe, progress), "lag-poller", shutdown)
    return Outcomes(
        sink=sink,
        seals=SealTrackingClient(sink, journal),
        watcher=watcher,
        archiver=archiver,
        archiving=archiving,
        probe=probe,
        closed_interrupted=closed,
    )


async def _poll_lag(probe: StageLagProbe, progress: RunProgress) -> None:
    """Keep the progress view's lag current (errors only leave it stale)."""
    while True:
        try:
            progress.lag = await probe.read()
        except Exception as exc:
            log.debug("lag reading failed: %s", exc)
        await asyncio.sleep(LAG_POLL_S)
