"""The sample archive hosted as a consumer of ``tokentrail.finalized``: every accepted
sample copied from the data plane into rotated files (``pipeline.samples.rotation``),
until SIGTERM or SIGINT (what ``tokentrail samples archive`` runs)."""

from __future__ import annotations

import asyncio

from pipeline.dataplane.config import AddressesFlag
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import ConsumerLoop
from pipeline.kafka.producer import KafkaEventSink
from pipeline.process.signals import STOP_SIGNALS
from pipeline.samples.rotation import ARCHIVE_GROUP, ArchiveStats, RotatingArchive, RotationSettings


class ArchiveSettings(RotationSettings):
    """The rotated files, the consumer group that fills them and the data plane it reads:
    each field is a ``tokentrail samples archive`` flag."""

    group: str = ARCHIVE_GROUP
    """consumer group"""
    dataplane_addresses: AddressesFlag = None


async def archive_samples(kafka: KafkaConfig, settings: ArchiveSettings) -> ArchiveStats:
    """Archive until stopped; what was buffered is on disk when this returns, and the
    samples after the last commit are delivered again after a restart."""
    from pipeline.dataplane import attach_data_plane

    async with (
        attach_data_plane(settings.dataplane_addresses) as plane,
        KafkaEventSink(kafka) as dead_letters,
    ):
        archive = RotatingArchive(plane, settings)
        loop = ConsumerLoop(
            kafka,
            group_id=settings.group,
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
