"""The samples' owner in the soak: a trainer feed that takes every batch and acknowledges it.

Without an owner nobody takes the finalizer's samples, so the data plane holds every
one of them and the finalizer its copies up to their budget (DESIGN §7.4): growth that
says nothing about a run with a trainer. This process stands in for the trainer: it
reads ``tokentrail.finalized`` in the trainer feed's group, fetches each batch's
samples and acknowledges the batch at once (the samples are deleted, the group
commits), so that every long-lived process of the soak sees what a training run does.
Acknowledgements run beside the next batches: one waits until the group can commit past
it, which an earlier group still incomplete holds back (up to ``GROUP_TIMEOUT_S``).

A process of its own, like ``bench.loadgen``, so that its memory is measured apart;
its settings reach it as arguments. It runs until stopped (SIGTERM).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from bench.child import run_child
from pipeline.dataplane import DataPlaneConfig, open_data_plane
from pipeline.kafka.config import KafkaConfig
from pipeline.trainer.feed import FeedSettings, TrainerFeed
from stages.ports import DataPlaneError
from stages.trainer.batch import TrainBatch
from topics.names import TopicNames

log = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 10.0
"""A group missing members (their rollouts died with a killed worker) is taken partial
after this long, so its samples do not wait for the end of the run."""
BATCH_WAIT_S = 1.0


async def main(args: argparse.Namespace) -> None:
    kafka = KafkaConfig(
        bootstrap_servers=args.bootstrap,
        names=TopicNames(prefix=args.prefix, partitions=args.partitions),
        client_id=f"sample-owner-{os.getpid()}",
    )
    settings = FeedSettings(
        group_size=args.group_size, group_timeout_s=GROUP_TIMEOUT_S, batch_wait_s=BATCH_WAIT_S
    )
    plane_config = DataPlaneConfig(mode="attach", data_dir=args.data_dir, timeout_s=args.dataplane_timeout)
    acknowledging: set[asyncio.Task[None]] = set()
    async with open_data_plane(plane_config) as plane, TrainerFeed(kafka, plane, settings) as feed:
        async for batch in feed.batches():
            task = asyncio.create_task(_acknowledge(feed, batch))
            acknowledging.add(task)
            task.add_done_callback(acknowledging.discard)


async def _acknowledge(feed: TrainerFeed, batch: TrainBatch) -> None:
    """Acknowledge a batch; one whose samples could not be deleted is said, not fatal
    (the group commits past it only once acknowledged, so it comes again after a restart)."""
    try:
        await feed.ack(batch)
    except DataPlaneError as exc:
        log.warning("acknowledging a batch of %d group(s) failed: %s", len(batch.groups), exc)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--partitions", type=int, required=True)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--group-size", type=int, required=True, help="rollouts per GRPO group")
    parser.add_argument("--dataplane-timeout", type=float, default=3.0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    run_child(main(parse()))
