"""The ledger stage on a real broker: SIGKILL and restart, replay equals live (in one
process and in shards)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import FAST_GROUPS
from pipeline.kafka.producer import KafkaEventSink
from pipeline.replay.parallel import rebuild_parallel
from pipeline.replay.rebuild import compare, materialize, rebuild
from pipeline.replay.store import LedgerStore
from pipeline.stagehost.recall import recall_answered
from pipeline.stagehost.runner import serve_stage
from stages.capture.cache import ChainCache
from stages.capture.core import AckPolicy, CaptureCore
from stages.capture.resolve import PrefixResolver
from stages.capture.writer import StagingWriter
from stages.client import RolloutClient
from stages.ledger.stage import LedgerConfig, LedgerStage
from stages.memory import MemoryDataPlane, RecordingSink
from stages.specs import LEDGER
from topics.records import Record, RolloutReceipt

pytestmark = pytest.mark.broker


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


async def receipts_on(config: KafkaConfig) -> dict[str, list[RolloutReceipt]]:
    """Every receipt copy on the committed topic, per rollout."""
    from pipeline.replay.rebuild import read_log

    copies: dict[str, list[RolloutReceipt]] = {}
    async for events, _, _ in read_log(config, [config.names.committed]):
        for item in events:
            if isinstance(item.event.payload, RolloutReceipt):
                copies.setdefault(item.event.key, []).append(item.event.payload)
    return copies


async def run_ledger_until(config: KafkaConfig, expected: int, within_s: float = 60) -> None:
    stop = asyncio.Event()
    async with KafkaEventSink(config) as sink:
        ledger = LedgerStage(sink, LedgerConfig(seal_grace_s=30))
        task = asyncio.create_task(serve_stage(ledger, LEDGER, config, sink, stop=stop, tuning=FAST_GROUPS))
        deadline = time.monotonic() + within_s
        while ledger.stats.receipts < expected and time.monotonic() < deadline:  # noqa: ASYNC110 (a counter, not an event)
            await asyncio.sleep(0.1)
        stop.set()
        await task
    assert ledger.stats.receipts == expected


def test_replay_rebuilds_the_live_ledger(kafka_config: KafkaConfig, tmp_path: Path) -> None:
    async def go() -> list[str]:
        await ensure_topics(kafka_config)
        rollouts = await captured_events(40)
        await publish_all(kafka_config, [e for r in rollouts for e in r])
        await run_ledger_until(kafka_config, expected=40)
        restarted = LedgerStage(RecordingSink())
        assert await recall_answered(restarted, LEDGER, kafka_config) == 40
        assert all(r[0].rollout_id in restarted.answered for r in rollouts)
        with (
            LedgerStore(tmp_path / "rebuilt.sqlite") as rebuilt,
            LedgerStore(tmp_path / "live.sqlite") as live,
        ):
            result = await rebuild(kafka_config, rebuilt, ledger=LedgerConfig(seal_grace_s=30))
            await materialize(kafka_config, live)
            assert result.open_rollouts == 0
            assert rebuilt.counts()["receipt"] == 40
            with LedgerStore(tmp_path / "sharded.sqlite") as sharded:
                # 4 partitions in 3 processes: shard 0 holds two of them
                apart = await rebuild_parallel(
                    kafka_config, sharded, processes=3, ledger=LedgerConfig(seal_grace_s=30)
                )
                assert (apart.events, apart.stored, apart.open_rollouts) == (result.events, result.stored, 0)
                assert compare(sharded, live) == []
            return compare(rebuilt, live)

    assert asyncio.run(go()) == []


def _stage_process(config: KafkaConfig) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "stage",
            "ledger",
            "--bootstrap",
            config.bootstrap,
            "--topic-prefix",
            config.names.prefix,
            "--partitions",
            str(config.names.partitions),
            "--seal-grace",
            "30",
            "--session-timeout-ms",
            "1000",
            "--heartbeat-ms",
            "300",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.mark.slow
def test_sigkill_and_restart_gives_one_identical_receipt_each(kafka_broker: Any, tmp_path: Path) -> None:
    from topics.names import TopicNames

    reference = kafka_broker.kafka_config(TopicNames(prefix=f"ref{os.getpid()}x", partitions=4))
    killed = kafka_broker.kafka_config(TopicNames(prefix=f"kill{os.getpid()}x", partitions=4))
    rollouts = asyncio.run(captured_events(120, seed=1))
    events = [e for r in rollouts for e in r]

    async def reference_run() -> dict[str, list[RolloutReceipt]]:
        await ensure_topics(reference)
        await publish_all(reference, events)
        await run_ledger_until(reference, expected=120)
        return await receipts_on(reference)

    expected = asyncio.run(reference_run())
    asyncio.run(ensure_topics(killed))
    rng = random.Random(7)
    chunks = [events[i : i + len(events) // 6 + 1] for i in range(0, len(events), len(events) // 6 + 1)]
    process = _stage_process(killed)
    try:
        for chunk in chunks:
            asyncio.run(publish_all(killed, chunk))
            time.sleep(rng.uniform(1.0, 3.0))
            process.send_signal(signal.SIGKILL)
            process.wait()
            process = _stage_process(killed)
        deadline = time.monotonic() + 90
        got: dict[str, list[RolloutReceipt]] = {}
        while time.monotonic() < deadline:
            got = asyncio.run(receipts_on(killed))
            if len(got) == 120:
                break
            time.sleep(1)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    assert sorted(got) == sorted(expected)
    for rollout_id, copies in got.items():
        distinct = {c.model_dump_json() for c in copies}
        assert len(distinct) == 1, f"{rollout_id} has {len(distinct)} different receipts"
        assert copies[0] == expected[rollout_id][0]
