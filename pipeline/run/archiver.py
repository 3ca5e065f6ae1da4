"""Copy each accepted sample of a run from the data plane into the durable archive.

This is a trainer's read path (``SampleReader`` over ``FinalizedEvent``s, fetching by
sample key) pointed at a file: the embedded data plane keeps samples in memory only,
so the archive is what outlives the run. Samples are archived as their events arrive,
not at the end, so an interrupted run keeps what it already finalized.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

from pipeline.samples.archive import SampleArchive, sample_record
from stages.finalize.reader import SampleReader
from stages.ports import DataPlane, DataPlaneError
from topics.records import FinalizedEvent

log = logging.getLogger(__name__)


class SampleArchiver:
    """Drains a stream of finalized events; ``written`` counts accepted samples (several
    per rollout under a multi-sample policy), ``failed`` the fetches that failed."""

    def __init__(
        self,
        data_plane: DataPlane,
        archive: SampleArchive,
        run_id: str,
        *,
        on_written: Callable[[int], None] | None = None,
    ) -> None:
        self.reader = SampleReader(data_plane)
        self.archive = archive
        self.run_id = run_id
        self._on_written = on_written
        self.written = 0
        self.tokens = 0
        self.failed: list[str] = []

    async def run(self, stream: Callable[[], AsyncIterator[FinalizedEvent]]) -> None:
        """Archive until ``stream()`` ends; a failed fetch is logged and counted, then the
        next event is taken from a fresh stream (the reader skips what it has seen)."""
        while True:
            try:
                async for rollout in self.reader.rollouts(stream()):
                    for sample in rollout.samples:
                        self.archive.append(sample_record(sample, self.run_id))
                        self.written += 1
                        self.tokens += len(sample.token_ids)
                    if rollout.samples and self._on_written is not None:
                        self._on_written(self.written)
                return
            except DataPlaneError as exc:
                self.failed.append(str(exc))
                log.error("archiving a sample failed: %s", exc)
