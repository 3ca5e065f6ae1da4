"""A second Kafka-protocol broker for the tests: noida-db's Kafka service, which keeps
Kafka's contract where the embedded broker departs from it (idempotent producers,
static group members, ListOffsets, DeleteRecords). Started once per test session on a
free port, its data in a temporary directory; the Kafka-contract path of
``pipeline.kafka`` is exercised against it (DESIGN §3)."""

from __future__ import annotations

import importlib.resources
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import FAST_GROUPS, ConsumerTuning
from pipeline.kafka.embedded.broker import free_port
from pipeline.kafka.embedded.probe import ProbeError, identify

START_TIMEOUT_S = 20.0
KAFKA_MIN_SESSION = ConsumerTuning(session_timeout_ms=6_000, heartbeat_interval_ms=500)
"""Kafka refuses a group session shorter than ``group.min.session.timeout.ms`` (6 s by default)."""


def fast_groups_on(config: KafkaConfig) -> ConsumerTuning:
    """The shortest group timings ``config``'s broker accepts: ``FAST_GROUPS`` on the
    embedded broker, Kafka's minimum session elsewhere."""
    if config.broker is not None and config.broker.kind == "tansu":
        return FAST_GROUPS
    return KAFKA_MIN_SESSION


def binary() -> Path:
    """The broker binary the ``noida-db`` wheel ships (made executable: the wheel's own
    launcher does the same)."""
    path = Path(str(importlib.resources.files("noida_db").joinpath("noida-db")))
    if not path.is_file():
        raise FileNotFoundError(f"noida-db: no broker binary at {path}; install the dev extra")
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return path


@contextmanager
def contract_broker() -> Iterator[str]:
    """Run the broker until the block ends; yields its bootstrap address."""
    port = free_port("127.0.0.1")
    with tempfile.TemporaryDirectory(prefix="tokentrail-contract-") as data_dir:
        log_path = Path(data_dir) / "broker.log"
        with log_path.open("wb") as log:
            command = [str(binary()), "start", "--only", "kafka", "--host", "127.0.0.1"]
            command += ["--kafka-port", str(port), "--data-dir", str(Path(data_dir) / "data")]
            process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
            try:
                _wait_ready(process, port, log_path)
                yield f"127.0.0.1:{port}"
            finally:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def _wait_ready(process: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"noida-db exited with {process.returncode}: {log_path.read_text()[-2000:]}")
        try:
            identify("127.0.0.1", port)
            return
        except (OSError, ProbeError):
            time.sleep(0.1)
    raise RuntimeError(f"noida-db did not answer on port {port} within {START_TIMEOUT_S} s")
