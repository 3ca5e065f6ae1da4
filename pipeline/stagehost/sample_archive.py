"""The sample archive hosted as a consumer of ``tokentrail.finalized``: every accepted
sample copied from the data plane into rotated files (``pipeline.samples.rotation``),
until SIGTERM or SIGINT (what ``tokentrail samples archive`` runs)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import ConsumerLoop
from pipeline.kafka.producer import KafkaEventSink
from pipeline.process.signals import STOP_SIGNALS
from pipeline.samples.rotation import ArchiveStats, RotatingArchive, RotationSettings


async def archive_samples(
    kafka: KafkaConfig, settings: RotationSettings, group: str, dataplane_addresses: Path | None
) -> ArchiveStats:
    """Archive until stopped; what was buffered is on disk when this returns, and the
    samples after the last commit are delivered again after a restart."""
    from pipeline.dataplane import attach_data_plane

    async with (
        attach_data_plane(dataplane_addresses) as plane,
        KafkaEventSink(kafka) as dead_letters,
    ):
        archive = RotatingArchive(plane, settings)
        loop = ConsumerLoop(
            kafka,
            group_id=group,
            topics=[kafka.names.finalized],
            handler=archive,
            dead_letters=dead_letters,
            stage="archive",
        )
        running = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            running.add_signal_handler(sig, loop.request_stop)
        try:
            await loop.run()
        finally:
            archive.rotate()
        return archive.stats
