"""Captured rollouts on the log: real capture (in-memory data plane) published to Kafka."""

from __future__ import annotations

import asyncio
import random
import time

from contractbroker import fast_groups_on

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.producer import KafkaEventSink
from pipeline.stagehost.runner import serve_stage
from stages.capture.cache import ChainCache
from stages.capture.core import AckPolicy, CaptureCore
from stages.capture.resolve import PrefixResolver
from stages.capture.writer import StagingWriter
from stages.client import RolloutClient
from stages.ledger.stage import LedgerConfig, LedgerStage
from stages.memory import MemoryDataPlane, RecordingSink
from stages.specs import LEDGER
from topics.records import Record


async def captured_events(rollouts: int, seed: int = 0) -> list[list[Record]]:
    """Real capture (in-memory data plane) of multi-turn rollouts, some with abandoned retries."""
    rng = random.Random(seed)
    sink = RecordingSink()
    plane = MemoryDataPlane()
    cache = ChainCache()
    writer = StagingWriter(plane, sink, worker_id="w0", batch_delay_s=0.0)
    core = CaptureCore(PrefixResolver(plane, cache), writer, cache, ack_policy=AckPolicy.STAGED)
    client = RolloutClient(sink, clock=lambda: 1_700_000_000.0)
    writer.start()
    per_rollout: list[list[Record]] = []
    for r in range(rollouts):
        rollout_id = f"r{seed}-{r}"
        start = len(sink.events)
        coords = None
        seen: list[int] = []
        for turn in range(rng.randint(1, 4)):
            if turn and rng.random() < 0.2:  # an abandoned retry of this turn
                retry = client.admit(rollout_id, coords, group_id=f"g{r // 4}")
                await client.publish_admission(retry)
                await core.complete(
                    await core.prepare(retry), [*seen, 9], [8], [-1.0], weight_version=0
                ).final_coords()
            admission = client.admit(rollout_id, coords, group_id=f"g{r // 4}")
            await client.publish_admission(admission)
            prompt = [*seen, 100 + turn, 101]
            gen = [rng.randint(200, 900) for _ in range(rng.randint(1, 5))]
            coords = await core.complete(
                await core.prepare(admission), prompt, gen, [-0.5] * len(gen), weight_version=0
            ).final_coords()
            seen = prompt + gen
        await client.seal(rollout_id, group_id=f"g{r // 4}", reward=float(r % 2))
        per_rollout.append([e.payload for e in sink.events[start:]])
    await writer.stop()
    return per_rollout


async def publish_all(config: KafkaConfig, events: list[Record]) -> None:
    async with KafkaEventSink(config) as sink:
        for i in range(0, len(events), 200):
            await sink.publish(events[i : i + 200])


async def run_ledger_until(config: KafkaConfig, expected: int, within_s: float = 60) -> None:
    stop = asyncio.Event()
    async with KafkaEventSink(config) as sink:
        ledger = LedgerStage(sink, LedgerConfig(seal_grace_s=30))
        task = asyncio.create_task(
            serve_stage(ledger, LEDGER, config, sink, stop=stop, tuning=fast_groups_on(config))
        )
        deadline = time.monotonic() + within_s
        while ledger.stats.receipts < expected and time.monotonic() < deadline:  # noqa: ASYNC110 (a counter, not an event)
            await asyncio.sleep(0.1)
        stop.set()
        await task
    assert ledger.stats.receipts == expected
