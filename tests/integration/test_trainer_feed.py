"""The trainer feed on the real broker and the real data plane.

Rollouts are captured through the real capture core into TransferQueue, the ledger and
finalizer stages turn them into samples on the tansu broker, and the feed (its own
consumer group) hands them to a trainer as tensors. A trainer process killed with
SIGKILL before acknowledging gets its batch again; acknowledged samples leave the data
plane and the group's lag drops to 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pipeline.dataplane.embedded import EmbeddedDataPlane
from pipeline.dataplane.transferqueue import TransferQueueDataPlane
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import FAST_GROUPS
from pipeline.kafka.lag import LagReader, total_lag
from pipeline.kafka.owners import KafkaSampleOwners
from pipeline.kafka.producer import KafkaEventSink
from pipeline.replay.rebuild import read_log
from pipeline.stagehost.runner import serve_stage
from pipeline.trainer.feed import TRAINER_GROUP, FeedSettings, TrainerFeed
from stages.capture.cache import ChainCache
from stages.capture.core import AckPolicy, CaptureCore
from stages.capture.resolve import PrefixResolver
from stages.capture.writer import StagingWriter
from stages.client import RolloutClient
from stages.finalize.retain import RetainedSamples
from stages.finalize.stage import FinalizerStage
from stages.ledger.stage import LedgerConfig, LedgerStage
from stages.ports import MissingRows
from stages.specs import FINALIZER, LEDGER
from stages.trainer.staleness import StalenessPolicy
from topics.names import TopicNames

pytestmark = [pytest.mark.broker, pytest.mark.dataplane]


@dataclass(frozen=True, slots=True)
class Rollout:
    rollout_id: str
    group_id: str
    reward: float
    version: int


@dataclass(slots=True)
class Pipeline:
    config: KafkaConfig
    addresses: Path
    server: EmbeddedDataPlane

    @contextlib.asynccontextmanager
    async def feed(self, **settings: Any) -> AsyncIterator[tuple[TransferQueueDataPlane, TrainerFeed]]:
        """A trainer's view: its own data-plane client and a feed with short group timings."""
        async with await TransferQueueDataPlane.attach(self.server.addresses, timeout_s=20.0) as plane:
            feed = TrainerFeed(
                self.config, plane, FeedSettings(tuning=FAST_GROUPS, **settings), lag_interval_s=0.5
            )
            async with feed:
                yield plane, feed


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedDataPlane]:
    with EmbeddedDataPlane.start() as embedded:
        yield embedded


@pytest.fixture
def pipeline(server: EmbeddedDataPlane, kafka_broker: Any, tmp_path: Path) -> Pipeline:
    kafka_broker.check()
    config = kafka_broker.kafka_config(
        TopicNames(prefix=f"t{uuid.uuid4().hex[:12]}", partitions=4), client_id="tokentrail-test"
    )
    return Pipeline(config, server.addresses.write(tmp_path / "dataplane.json"), server)


async def produce(
    pipeline: Pipeline, rollouts: list[Rollout], retained: RetainedSamples | None = None
) -> None:
    """Two-turn rollouts captured for real, then ledger and finalizer until all are finalized."""
    config = pipeline.config
    await ensure_topics(config)
    async with (
        await TransferQueueDataPlane.attach(pipeline.server.addresses, timeout_s=20.0) as plane,
        KafkaEventSink(config) as sink,
    ):
        cache = ChainCache()
        writer = StagingWriter(plane, sink, worker_id="w0", batch_delay_s=0.002)
        writer.start()
        core = CaptureCore(PrefixResolver(plane, cache), writer, cache, ack_policy=AckPolicy.STAGED)
        client = RolloutClient(sink)
        for rollout in rollouts:
            coords = None
            seen: list[int] = []
            for turn in range(2):
                admission = client.admit(rollout.rollout_id, coords, group_id=rollout.group_id)
                await client.publish_admission(admission)
                prompt = [*seen, 100 + turn, 101]
                gen = [7 + turn, 8]
                completion = core.complete(
                    await core.prepare(admission), prompt, gen, [-0.5, -0.25], weight_version=rollout.version
                )
                coords = await completion.final_coords()
                seen = prompt + gen
            await client.seal(rollout.rollout_id, group_id=rollout.group_id, reward=rollout.reward)
        await writer.stop()
        stop = asyncio.Event()
        finalizer = FinalizerStage(plane, sink, retained=retained)
        tasks = [
            asyncio.create_task(serve_stage(stage, spec, config, sink, stop=stop, tuning=FAST_GROUPS))
            for stage, spec in (
                (LedgerStage(sink, LedgerConfig(seal_grace_s=30)), LEDGER),
                (finalizer, FINALIZER),
            )
        ]
        deadline = time.monotonic() + 60
        while finalizer.stats.accepted < len(rollouts) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        stop.set()
        await asyncio.gather(*tasks)
        assert finalizer.stats.accepted == len(rollouts)


def two_groups(version: tuple[int, int] = (0, 0)) -> list[Rollout]:
    return [
        Rollout(f"r{uuid.uuid4().hex[:8]}-{g}-{i}", f"g{g}", float(i % 2), version[g])
        for g in range(2)
        for i in range(4)
    ]


async def trainer_lag(config: KafkaConfig) -> int:
    async with LagReader(config) as reader:
        return total_lag(await reader.group_lag(TRAINER_GROUP, [config.names.finalized]))


def test_complete_groups_as_tensors_then_acknowledged_and_gone(pipeline: Pipeline) -> None:
    rollouts = two_groups()

    async def go() -> None:
        await produce(pipeline, rollouts)
        async with pipeline.feed(group_size=4, groups_per_batch=2) as (plane, feed):
            batch = await asyncio.wait_for(feed.next_batch(), 60)
            assert sorted(g.group_id for g in batch.groups) == ["g0", "g1"]
            assert all(len(g.members) == 4 and not g.partial for g in batch.groups)
            assert batch.input_ids.shape == (8, 8) and batch.loss_mask.sum() == 32
            assert batch.old_logprobs[0].tolist() == [0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -0.5, -0.25]
            for group in range(2):  # half the rewards are 1: advantages are +-1 within each group
                chunk = batch.advantages[group * 4 : group * 4 + 4].tolist()
                assert sorted(round(a, 4) for a in chunk) == [-1.0, -1.0, 1.0, 1.0]
            keys = [s.key for s in batch.samples]
            assert len(await plane.get_samples(keys)) == 8
            assert await trainer_lag(pipeline.config) == 8
            await feed.ack(batch)
            with pytest.raises(MissingRows):
                await plane.get_samples(keys[:1])
            assert not {k for k in await plane.list_keys("samples") if k in keys}
        assert await trainer_lag(pipeline.config) == 0

    asyncio.run(go())


def test_the_finalizer_keeps_each_sample_until_the_trainer_acknowledged_it(pipeline: Pipeline) -> None:
    """Samples lost with the data plane before the trainer read them are put back from the
    finalizer's copies; once the trainer acknowledged them, the copies are let go."""
    rollouts = two_groups()

    async def go() -> None:
        async with LagReader(pipeline.config) as reader:
            owners = KafkaSampleOwners(reader, [TRAINER_GROUP])
            retained = RetainedSamples(owners)
            await produce(pipeline, rollouts, retained)
            assert len(retained) == 8
            placed = {}
            async for events, _, _ in read_log(pipeline.config, [pipeline.config.names.finalized]):
                placed |= {item.event.key: item.partition for item in events}
            assert placed == {r.rollout_id: owners.partition_of(r.rollout_id) for r in rollouts}
            await retained.check()
            assert len(retained) == 8  # the trainer has not committed anything
            assert sorted(await owners.unacknowledged()) == sorted(placed)
            async with pipeline.feed(group_size=4, groups_per_batch=2) as (plane, feed):
                keys = [r.rollout_id for r in rollouts]
                await plane.delete_samples(keys)  # gone with the data plane, unread
                await retained.restore(plane)
                assert retained.stats.restored == 8
                batch = await asyncio.wait_for(feed.next_batch(), 60)
                assert sorted(s.rollout_id for s in batch.samples) == sorted(keys)
                await feed.ack(batch)
            await retained.check()
            assert len(retained) == 0 and retained.stats.released == 8
            assert await owners.unacknowledged() == []

    asyncio.run(go())


CHILD = """
import asyncio, json, sys
from pathlib import Path
from pipeline.dataplane.addresses import DataPlaneAddresses
from pipeline.dataplane.transferqueue import TransferQueueDataPlane
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import FAST_GROUPS
from pipeline.trainer.feed import FeedSettings, TrainerFeed
from topics.names import TopicNames

async def main():
    config = KafkaConfig(sys.argv[1], names=TopicNames(prefix=sys.argv[2], partitions=4))
    addresses = DataPlaneAddresses.read(Path(sys.argv[3]))
    async with await TransferQueueDataPlane.attach(addresses, timeout_s=20.0) as plane:
        async with TrainerFeed(config, plane, FeedSettings(group_size=4, tuning=FAST_GROUPS)) as feed:
            batch = await feed.next_batch()
            print(json.dumps(sorted(s.rollout_id for s in batch.samples)), flush=True)
            await asyncio.sleep(3600)  # training, never acknowledged: killed here

asyncio.run(main())
"""


def test_a_killed_trainer_gets_its_unacknowledged_batch_again(pipeline: Pipeline) -> None:
    rollouts = two_groups()
    asyncio.run(produce(pipeline, rollouts))
    config = pipeline.config
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            CHILD,
            config.bootstrap_servers or "",
            config.names.prefix,
            str(pipeline.addresses),
        ],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        assert child.stdout is not None
        first = json.loads(child.stdout.readline())
        assert len(first) == 4
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)

    async def go() -> list[str]:
        async with pipeline.feed(group_size=4, groups_per_batch=2) as (_plane, feed):
            batch = await asyncio.wait_for(feed.next_batch(), 60)
            await feed.ack(batch)
            return sorted(s.rollout_id for s in batch.samples)

    again = asyncio.run(go())
    assert set(first) <= set(again) and len(again) == 8  # nothing was committed by the killed one
    assert asyncio.run(trainer_lag(config)) == 0


def test_stale_samples_are_dropped_and_still_deleted(pipeline: Pipeline) -> None:
    rollouts = two_groups(version=(0, 3))

    async def go() -> None:
        await produce(pipeline, rollouts)
        async with pipeline.feed(
            group_size=4, groups_per_batch=2, staleness=StalenessPolicy(max_staleness=1)
        ) as (plane, feed):
            feed.policy_version = 3
            batch = await asyncio.wait_for(feed.next_batch(), 60)
            assert {s.group_id for s in batch.samples} == {"g1"} and len(batch) == 4
            assert len(batch.stale) == 4 and batch.weight_versions.tolist() == [[3, 3]] * 4
            await feed.ack(batch)
            left = set(await plane.list_keys("samples"))
            assert not left & {r.rollout_id for r in rollouts}

    asyncio.run(go())


def test_a_group_missing_members_is_released_partial_after_its_timeout(pipeline: Pipeline) -> None:
    rollouts = two_groups()[:3]  # one member of g0 never comes

    async def go() -> None:
        await produce(pipeline, rollouts)
        async with pipeline.feed(group_size=4, group_timeout_s=1.0) as (_plane, feed):
            batch = await asyncio.wait_for(feed.next_batch(), 60)
            (group,) = batch.groups
            assert group.partial and len(group.members) == 3 and len(batch) == 3
            registry = feed.stage_metrics.registry
            assert registry.get_sample_value("tokentrail_trainer_groups_total", {"kind": "partial"}) == 1
            await feed.ack(batch)

    asyncio.run(go())


def test_a_trainer_in_admission_order_takes_the_groups_it_names(pipeline: Pipeline) -> None:
    """Paced, a step trains its own groups: g1 when asked for, though g0 finished first."""
    rollouts = two_groups(version=(0, 1))

    async def go() -> None:
        await produce(pipeline, rollouts)
        async with pipeline.feed(group_size=4, groups_per_batch=1) as (_plane, feed):
            feed.policy_version = 1
            named = await asyncio.wait_for(feed.next_batch(groups={"g1"}), 60)
            assert [g.group_id for g in named.groups] == ["g1"] and named.staleness.tolist() == [0] * 4
            rest = await asyncio.wait_for(feed.next_batch(), 60)
            assert [g.group_id for g in rest.groups] == ["g0"] and rest.staleness.tolist() == [1] * 4
            await feed.ack(named)
            await feed.ack(rest)

    asyncio.run(go())
