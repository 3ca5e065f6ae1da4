"""Replay in shard processes: refused when topics cannot be split, a shard's death fails
the replay naming it, and a SIGKILLed replay leaves no shard behind.

(That the shards' merged ledger equals the live one is in ``test_ledger_stage``.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from bench.events import rollout_events
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.config import ConfigError, KafkaConfig
from pipeline.kafka.embedded.broker import EmbeddedBroker
from pipeline.kafka.producer import KafkaEventSink
from pipeline.replay.parallel import ShardFailed, rebuild_parallel
from pipeline.replay.store import LedgerStore

pytestmark = pytest.mark.broker


def _shards_of(pid: int) -> list[psutil.Process]:
    """The spawned shard processes below ``pid``."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for child in children:
        try:
            if any("multiprocessing.spawn" in part or "spawn_main" in part for part in child.cmdline()):
                found.append(child)
        except psutil.Error:
            continue
    return found


async def _wait_for_shards(pid: int, count: int, within_s: float = 30) -> list[psutil.Process]:
    deadline = time.monotonic() + within_s
    while len(shards := _shards_of(pid)) < count:
        assert time.monotonic() < deadline, f"{len(shards)} shard process(es) started, not {count}"
        await asyncio.sleep(0.01)
    return shards


async def _fill(config: KafkaConfig, rollouts: int) -> None:
    await ensure_topics(config)
    async with KafkaEventSink(config) as sink:
        for number in range(rollouts):
            await sink.publish(rollout_events(f"r{number}", 2))


def test_topics_with_different_partition_counts_are_refused(
    kafka_config: KafkaConfig, tmp_path: Path
) -> None:
    async def go() -> None:
        admin = AIOKafkaAdminClient(**kafka_config.client_kwargs())
        await admin.start()
        try:
            names = kafka_config.names
            await admin.create_topics([NewTopic(names.admission, 2, 1), NewTopic(names.staged, 3, 1)])
        finally:
            await admin.close()
        with LedgerStore(tmp_path / "ledger.sqlite") as store:
            await rebuild_parallel(kafka_config, store, processes=2)

    with pytest.raises(ConfigError, match="processes: the input topics have different partition counts"):
        asyncio.run(go())


def test_a_killed_shard_fails_the_replay_naming_it(kafka_config: KafkaConfig, tmp_path: Path) -> None:
    async def go() -> None:
        await _fill(kafka_config, 40)
        with LedgerStore(tmp_path / "ledger.sqlite") as store:
            replay = asyncio.create_task(rebuild_parallel(kafka_config, store, processes=2))
            shards = await _wait_for_shards(os.getpid(), 2)
            shards[0].kill()  # still starting: it cannot have finished
            await replay

    with pytest.raises(ShardFailed, match=r"replay shard \d of 2 exited with code -9"):
        asyncio.run(go())


@contextmanager
def _paused(broker: EmbeddedBroker) -> Iterator[None]:
    """The broker stopped (SIGSTOP): its clients wait, neither failing nor finishing."""
    os.kill(broker.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(broker.pid, signal.SIGCONT)


def test_a_sigkilled_replay_leaves_no_shard(
    kafka_broker: EmbeddedBroker, kafka_config: KafkaConfig, tmp_path: Path
) -> None:
    asyncio.run(_fill(kafka_config, 40))
    command = [
        sys.executable, "-m", "pipeline.cli", "replay", "--bootstrap", kafka_config.bootstrap,
        "--topic-prefix", kafka_config.names.prefix, "--partitions", str(kafka_config.names.partitions),
        "--out", str(tmp_path / "ledger.sqlite"), "--processes", "2", "--json",
    ]  # fmt: skip
    replay = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        shards = asyncio.run(_wait_for_shards(replay.pid, 2))
        with _paused(kafka_broker):  # the shards hang on the broker: only a kill ends them
            replay.kill()
            replay.wait()
            _, alive = psutil.wait_procs(shards, timeout=10)
        assert not alive, f"shards outlived their SIGKILLed replay: {[p.pid for p in alive]}"
    finally:
        if replay.poll() is None:
            replay.kill()
