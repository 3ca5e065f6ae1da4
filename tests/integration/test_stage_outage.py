"""A stage process rides out the broker going away, with no supervisor restarting it.

``tokentrail stage ledger`` is started before any broker listens on its bootstrap
address (it must wait, not exit); then the durable broker is SIGKILLed mid-run and
started again on its store. The same stage process must receipt every rollout.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.events import rollout_events
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.embedded.broker import EmbeddedBroker, free_port
from pipeline.kafka.lag import LagReader, total_lag
from pipeline.kafka.producer import KafkaEventSink
from stages.specs import LEDGER

pytestmark = [pytest.mark.slow, pytest.mark.broker]

REPO = Path(__file__).resolve().parents[2]


def durable_broker(data_dir: Path, port: int) -> EmbeddedBroker:
    return EmbeddedBroker(storage="durable", data_dir=data_dir, port=port, startup_timeout=60).start()


async def publish_rollouts(config: KafkaConfig, prefix: str, count: int) -> None:
    async with KafkaEventSink(config) as sink:
        await sink.publish([e for i in range(count) for e in rollout_events(f"{prefix}{i}", 2)])


async def ledger_lag(config: KafkaConfig) -> int:
    async with LagReader(config) as reader:
        return total_lag(await reader.group_lag(LEDGER.group, LEDGER.inputs(config.names)))


def wait_for_no_lag(config: KafkaConfig, stage: subprocess.Popen[bytes], timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    lag: int | None = None
    while time.monotonic() < deadline:
        assert stage.poll() is None, f"the stage exited ({stage.returncode}) instead of riding it out"
        lag = asyncio.run(ledger_lag(config))
        if lag == 0:
            return
        time.sleep(0.5)
    raise AssertionError(f"ledger lag still {lag} after {timeout_s}s")


def test_a_stage_waits_for_the_broker_and_rides_out_its_restart(tmp_path: Path) -> None:
    port = free_port()
    log = (tmp_path / "stage.log").open("wb")
    fast = ["--session-timeout-ms", "1000", "--heartbeat-ms", "300", "--seal-grace", "1"]
    stage = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "stage", "ledger", "--bootstrap", f"127.0.0.1:{port}", *fast],
        cwd=REPO,
        stdout=log,
        stderr=log,
    )
    broker: EmbeddedBroker | None = None
    try:
        time.sleep(3)
        assert stage.poll() is None, "the stage gave up on a broker that was not there yet"
        broker = durable_broker(tmp_path / "broker", port)
        config = broker.kafka_config()
        asyncio.run(ensure_topics(config))
        asyncio.run(publish_rollouts(config, "before", 5))
        wait_for_no_lag(config, stage)

        os.kill(broker.pid, signal.SIGKILL)  # tansu crashes; its store stays
        time.sleep(2)
        broker.stop()
        broker = durable_broker(tmp_path / "broker", port)
        asyncio.run(publish_rollouts(config, "after", 5))
        wait_for_no_lag(config, stage)
    finally:
        stage.send_signal(signal.SIGTERM)
        code = stage.wait(60)
        if broker is not None:
            broker.stop()
        log.close()
    assert code == 0, (tmp_path / "stage.log").read_text()[-3000:]
    assert b"starting again" in (tmp_path / "stage.log").read_bytes()  # it did wait for the broker
