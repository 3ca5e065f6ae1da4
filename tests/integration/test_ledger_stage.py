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
from ledgerkit import captured_events, publish_all, run_ledger_until

from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.config import KafkaConfig
from pipeline.replay.parallel import rebuild_parallel
from pipeline.replay.rebuild import compare, materialize, rebuild
from pipeline.replay.store import LedgerStore
from pipeline.stagehost.recall import recall_answered
from stages.ledger.stage import LedgerConfig, LedgerStage
from stages.memory import RecordingSink
from stages.specs import LEDGER
from topics.records import RolloutReceipt

pytestmark = pytest.mark.broker


async def receipts_on(config: KafkaConfig) -> dict[str, list[RolloutReceipt]]:
    """Every receipt copy on the committed topic, per rollout."""
    from pipeline.replay.rebuild import read_log

    copies: dict[str, list[RolloutReceipt]] = {}
    async for events, _, _ in read_log(config, [config.names.committed]):
        for item in events:
            if isinstance(item.event.payload, RolloutReceipt):
                copies.setdefault(item.event.key, []).append(item.event.payload)
    return copies


def test_replay_rebuilds_the_live_ledger(either_config: KafkaConfig, tmp_path: Path) -> None:
    kafka_config = either_config

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
