"""The embedded broker supervisor: readiness, clear failures, durable restarts, the CLI verb."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import CollectingHandler, ConsumerLoop, ConsumerTuning
from pipeline.kafka.embedded.broker import BrokerError, EmbeddedBroker, PortBusyError, free_port, tansu_binary
from pipeline.kafka.embedded.probe import identify
from pipeline.kafka.lag import LagReader, total_lag
from pipeline.kafka.producer import KafkaEventSink
from pipeline.kafka.reader import assigned_reader
from pipeline.kafka.tail import recent_keys
from stages.ports import Consumed
from topics.events import EventType
from topics.names import TopicNames
from topics.records import CaptureAdmission

pytestmark = pytest.mark.broker

# Runs just the ``broker`` verb, so the test does not import every other verb's dependencies.
BROKER_VERB = (
    "import argparse, sys\n"
    "from pipeline.commands import broker\n"
    "parser = argparse.ArgumentParser(prog='tokentrail')\n"
    "broker.add_parser(parser.add_subparsers())\n"
    "args = parser.parse_args(sys.argv[1:])\n"
    "sys.exit(args.run(args))\n"
)


def admissions(count: int) -> list[CaptureAdmission]:
    return [
        CaptureAdmission(rollout_id=f"r{i % 7}", call_id=f"c{i}", prev_len=0, mode="text", admitted_at=1.0)
        for i in range(count)
    ]


def port_accepts(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_memory_broker_answers_with_its_own_cluster_id_and_stops_cleanly() -> None:
    broker = EmbeddedBroker()
    broker.start()
    try:
        identity = identify("127.0.0.1", broker.port)
        assert identity.cluster_id == broker.cluster_id
        assert identity.advertised == (("127.0.0.1", broker.port),)
        assert 18 in identity.api_versions and broker.running
        pid = broker.pid
    finally:
        broker.stop()
    assert not broker.running and broker.failure is None
    assert not port_accepts(broker.port)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_async_context_manager() -> None:
    async def use() -> tuple[str, bool]:
        async with EmbeddedBroker() as broker:
            await ensure_topics(broker.kafka_config(TopicNames(prefix="ctx", partitions=1)))
            return broker.bootstrap, broker.running

    bootstrap, running = asyncio.run(use())
    assert running and not port_accepts(int(bootstrap.rsplit(":", 1)[1]))


def test_a_busy_port_is_a_clear_error(kafka_broker: EmbeddedBroker) -> None:
    with pytest.raises(PortBusyError, match="busy"):
        EmbeddedBroker(port=kafka_broker.port).start()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        with pytest.raises(PortBusyError, match="busy"):
            EmbeddedBroker(port=squatter.getsockname()[1]).start()
    kafka_broker.check()  # the session broker is untouched


def test_tansu_exiting_zero_on_a_taken_port_is_still_caught(
    kafka_broker: EmbeddedBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the pre-check, readiness alone must catch it: tansu exits 0, or another
    broker answers with a foreign cluster id."""
    monkeypatch.setattr("pipeline.kafka.embedded.broker.ensure_port_free", lambda host, port: None)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        with pytest.raises(PortBusyError, match="exited with code 0"):
            EmbeddedBroker(port=squatter.getsockname()[1]).start()
    with pytest.raises(PortBusyError, match=r"another Kafka broker|exited with code 0"):
        EmbeddedBroker(port=kafka_broker.port).start()
    kafka_broker.check()


def test_a_missing_binary_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(BrokerError, match="missing or not executable"):
        EmbeddedBroker(binary=tmp_path / "tansu").start()
    monkeypatch.setenv("TOKENTRAIL_TANSU_BIN", str(tmp_path / "nope"))
    with pytest.raises(BrokerError, match="TOKENTRAIL_TANSU_BIN"):
        tansu_binary()
    monkeypatch.delenv("TOKENTRAIL_TANSU_BIN")
    assert tansu_binary().is_file()


def test_port_zero_is_refused() -> None:
    with pytest.raises(BrokerError, match="port 0"):
        EmbeddedBroker(port=0)


@pytest.mark.parametrize("storage", ["memory", "durable"])
def test_a_broker_that_dies_is_reported(storage: str, tmp_path: Path) -> None:
    failures: list[BrokerError] = []
    broker = EmbeddedBroker(
        storage="durable" if storage == "durable" else "memory",
        data_dir=tmp_path if storage == "durable" else None,
    )
    broker.on_failure(failures.append)
    with broker:
        os.kill(broker.pid, signal.SIGKILL)
        failure = broker.wait(timeout=10)
        assert failure is not None and "exited unexpectedly" in str(failure)
        assert "tansu" in str(failure) and not broker.running
        with pytest.raises(BrokerError, match="exited unexpectedly"):
            broker.check()
    assert failures == [failure]


def test_durable_storage_dying_is_reported(tmp_path: Path) -> None:
    with EmbeddedBroker(storage="durable", data_dir=tmp_path) as broker:
        assert broker.bucket_pid is not None
        os.kill(broker.bucket_pid, signal.SIGKILL)
        failure = broker.wait(timeout=10)
        assert failure is not None and "localbucket" in str(failure)


def test_durable_storage_needs_its_own_data_dir(tmp_path: Path) -> None:
    with pytest.raises(BrokerError, match="data directory"):
        EmbeddedBroker(storage="durable")
    with EmbeddedBroker(storage="durable", data_dir=tmp_path), pytest.raises(BrokerError, match="in use"):
        EmbeddedBroker(storage="durable", data_dir=tmp_path).start()


def test_durable_broker_keeps_topics_records_and_offsets_across_a_restart(
    tmp_path: Path, fast_group: ConsumerTuning
) -> None:
    names = TopicNames(prefix="durable", partitions=2)
    group = "durable-g"
    records = admissions(120)

    async def first_life(bootstrap: str) -> int:
        config = KafkaConfig(bootstrap_servers=bootstrap, names=names)
        await ensure_topics(config)
        async with KafkaEventSink(config, linger_ms=10) as sink:
            await sink.publish(records)
            loop: ConsumerLoop | None = None

            async def stop_midway(batch: Sequence[Consumed]) -> None:
                if loop is not None and len(handler.consumed) + len(batch) >= 50:
                    loop.request_stop()

            handler = CollectingHandler(on_batch=stop_midway)
            loop = ConsumerLoop(
                config,
                group_id=group,
                topics=[names.admission],
                handler=handler,
                dead_letters=sink,
                stage="test",
                tuning=replace(fast_group, max_records=20),
            )
            await asyncio.wait_for(loop.run(), 20)
            return len(handler.consumed)

    async def second_life(bootstrap: str, consumed: int) -> None:
        config = KafkaConfig(bootstrap_servers=bootstrap, names=names)
        assert await ensure_topics(config) == []  # the topics survived
        async with LagReader(config) as reader:
            rows = await reader.group_lag(group)
            assert total_lag(rows) == len(records) - consumed  # committed offsets survived
            assert sum(row.highwater for row in rows) == len(records)
        async with KafkaEventSink(config) as sink:
            everything = CollectingHandler()
            rest = CollectingHandler()
            loops = [
                ConsumerLoop(
                    config,
                    group_id="durable-replay",
                    topics=[names.admission],
                    handler=everything,
                    dead_letters=sink,
                    stage="test",
                    tuning=fast_group,
                ),
                ConsumerLoop(
                    config,
                    group_id=group,
                    topics=[names.admission],
                    handler=rest,
                    dead_letters=sink,
                    stage="test",
                    tuning=fast_group,
                ),
            ]
            tasks = [asyncio.create_task(loop.run()) for loop in loops]
            try:
                await everything.wait_for(len(records))
                await rest.wait_for(len(records) - consumed)
                await asyncio.sleep(0.2)
            finally:
                for loop in loops:
                    loop.request_stop()
                await asyncio.wait_for(asyncio.gather(*tasks), 20)
        replayed = [item.event.payload for item in everything.consumed]
        assert sorted(r.model_dump_json() for r in replayed) == sorted(r.model_dump_json() for r in records)
        assert len(rest.consumed) == len(records) - consumed

    with EmbeddedBroker(storage="durable", data_dir=tmp_path) as broker:
        cluster_id = broker.cluster_id
        consumed = asyncio.run(first_life(broker.bootstrap))
    assert 50 <= consumed < len(records)
    with EmbeddedBroker(storage="durable", data_dir=tmp_path) as broker:
        assert broker.cluster_id == cluster_id
        asyncio.run(second_life(broker.bootstrap, consumed))


def test_concurrent_producers_on_one_durable_partition_all_land(tmp_path: Path) -> None:
    """The durable store refuses a batch whose offset another producer took at the same
    moment; the sink sends it again, so every record lands once."""
    names = TopicNames(prefix="conflicts", partitions=1)
    producers, each = 4, 25

    async def produce_and_read(bootstrap: str) -> list[str]:
        config = KafkaConfig(bootstrap_servers=bootstrap, names=names)
        await ensure_topics(config)
        sinks = [KafkaEventSink(config, linger_ms=0) for _ in range(producers)]
        for sink in sinks:
            await sink.start()
        try:

            async def one_at_a_time(number: int, sink: KafkaEventSink) -> None:
                for record in admissions(each * producers)[number::producers]:
                    await sink.publish([record])

            await asyncio.gather(*(one_at_a_time(n, sink) for n, sink in enumerate(sinks)))
        finally:
            for sink in sinks:
                await sink.stop()
        async with KafkaEventSink(config) as sink:
            handler = CollectingHandler()
            loop = ConsumerLoop(
                config, group_id="conflicts-g", topics=[names.admission], handler=handler,
                dead_letters=sink, stage="test",
            )  # fmt: skip
            task = asyncio.create_task(loop.run())
            try:
                await handler.wait_for(each * producers)
                await asyncio.sleep(0.3)  # anything extra would show now
            finally:
                loop.request_stop()
                await asyncio.wait_for(task, 20)
        return [item.event.payload.call_id for item in handler.consumed]

    with EmbeddedBroker(storage="durable", data_dir=tmp_path) as broker:
        calls = asyncio.run(produce_and_read(broker.bootstrap))
    assert sorted(calls) == sorted(f"c{i}" for i in range(each * producers))


UNWRITTEN = TopicNames(prefix="unwritten", partitions=1)


async def publish_one_per_batch(bootstrap: str, records: list[CaptureAdmission]) -> None:
    config = KafkaConfig(bootstrap_servers=bootstrap, names=UNWRITTEN)
    await ensure_topics(config)
    async with KafkaEventSink(config, linger_ms=0) as sink:
        for record in records:
            await sink.publish([record])


def store_left_by_a_kill_mid_produce(data_dir: Path) -> list[CaptureAdmission]:
    """A durable store as a kill between tansu's two writes of a produce (the watermark,
    then the batch) leaves it: admissions 0 and 1 written, the watermark at 3."""
    records = admissions(3)
    with EmbeddedBroker(storage="durable", data_dir=data_dir) as broker:
        asyncio.run(publish_one_per_batch(broker.bootstrap, records))
        topics = data_dir / "s3" / "tansu" / "clusters" / broker.cluster_id / "topics"
    partition_dir = topics / UNWRITTEN.admission / "partitions" / "0000000000"
    (partition_dir / "records" / f"{2:020d}.batch").unlink()
    assert json.loads((partition_dir / "watermark.json").read_text())["high"] == 3
    return records


async def recall_and_read(
    bootstrap: str, stall_warning_s: float = 30.0, recall_timeout_s: float = 20.0
) -> tuple[list[str], list[str]]:
    """The admissions' keys as a stage's recall reads them (to the high watermark), and
    every record as ``offset:key``."""
    config = KafkaConfig(bootstrap_servers=bootstrap, names=UNWRITTEN)
    recalled = await asyncio.wait_for(
        recent_keys(
            config,
            UNWRITTEN.admission,
            EventType.ADMISSION,
            per_partition=10,
            stall_warning_s=stall_warning_s,
        ),
        recall_timeout_s,
    )
    async with LagReader(config) as reader:
        (partition,) = await reader.partitions([UNWRITTEN.admission])
        end = (await reader.watermarks([partition]))[partition].highwater
    async with assigned_reader(config, {partition: 0}) as consumer:
        read: list[str] = []
        while len(read) < end:
            for batch in (await asyncio.wait_for(consumer.getmany(timeout_ms=500), 20)).values():
                read += [f"{record.offset}:{record.key.decode()}" for record in batch if record.key]
    return recalled, read


def test_offsets_a_killed_broker_never_wrote_are_given_back(tmp_path: Path) -> None:
    """Started again on such a store, the broker gives the unwritten offset back, so a read
    up to the high watermark ends and the next record takes the offset."""
    records = store_left_by_a_kill_mid_produce(tmp_path)
    with EmbeddedBroker(storage="durable", data_dir=tmp_path) as broker:
        assert [(g.topic, g.partition, g.written_end, g.claimed_end) for g in broker.given_back] == [
            (UNWRITTEN.admission, 0, 2, 3)
        ]
        assert asyncio.run(recall_and_read(broker.bootstrap)) == (["r0", "r1"], ["0:r0", "1:r1"])
        asyncio.run(publish_one_per_batch(broker.bootstrap, records[2:]))
        assert asyncio.run(recall_and_read(broker.bootstrap))[1] == ["0:r0", "1:r1", "2:r2"]
    with EmbeddedBroker(storage="durable", data_dir=tmp_path) as broker:
        assert broker.given_back == []


def test_without_the_give_back_the_recall_waits_and_names_the_partition(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """What a stage met before: its recall of answered rollouts reads toward an offset that
    never comes, so the stage is never ready; the reader says which partition holds it."""
    store_left_by_a_kill_mid_produce(tmp_path)
    monkeypatch.setattr("pipeline.kafka.embedded.broker.give_back_unwritten", lambda cluster_dir: [])
    with (
        EmbeddedBroker(storage="durable", data_dir=tmp_path) as broker,
        caplog.at_level("WARNING"),
        pytest.raises(TimeoutError),
    ):
        asyncio.run(recall_and_read(broker.bootstrap, stall_warning_s=1.0, recall_timeout_s=3.0))
    assert (
        f"reading {UNWRITTEN.admission}[0] up to its high watermark 3: no record at offset 2" in caplog.text
    )


def test_broker_command_runs_in_the_foreground_and_stops_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            BROKER_VERB,
            "broker",
            "--port",
            str(port),
            "--create-topics",
            "--topic-prefix",
            "cli",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    timer = threading.Timer(30, process.kill)
    timer.start()
    try:
        assert process.stdout is not None
        ready = json.loads(process.stdout.readline())
        assert ready["bootstrap"] == f"127.0.0.1:{port}" and ready["storage"] == "memory"
        assert sorted(ready["created_topics"]) == sorted(TopicNames(prefix="cli").all())
        assert identify("127.0.0.1", port).cluster_id == ready["cluster_id"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    finally:
        timer.cancel()
        if process.poll() is None:
            process.kill()
    assert not port_accepts(port)


def _broker_cli(data_dir: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "broker", "--data-dir", str(data_dir), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def test_one_broker_per_store_and_a_dead_holder_is_taken_over(tmp_path: Path) -> None:
    holder = _broker_cli(tmp_path)
    try:
        assert holder.stdout is not None
        first = json.loads(holder.stdout.readline())
        second = _broker_cli(tmp_path)
        _, err = second.communicate(timeout=60)
        assert second.returncode == 3, err
        assert f"in use by the broker of process {holder.pid}" in err and str(tmp_path) in err
        children = psutil.Process(holder.pid).children(recursive=True)
        holder.send_signal(signal.SIGKILL)  # its tansu and storage server die with it
        holder.wait()
        assert psutil.wait_procs(children, timeout=10)[1] == []
        third = _broker_cli(tmp_path)
        try:
            assert third.stdout is not None
            taken = json.loads(third.stdout.readline())
            assert taken["cluster_id"] == first["cluster_id"]  # the same store, taken over
        finally:
            third.send_signal(signal.SIGTERM)
            assert third.wait(30) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
