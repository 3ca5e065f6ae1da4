"""deploy/README.md's "one machine, many processes", run line by line as an operator would.

The commands are read from the README itself (so the walkthrough cannot drift from what
works): a durable broker, a data plane, two replicas of each stage, a vLLM worker, the
sample archiver, then ``tokentrail drive``. Mid-drive one replica of each stage is killed
with SIGKILL. Every rollout must get exactly one outcome, the stages' lag must reach 0,
``replay --check`` must find the live ledger equal to a rebuild, the archiver's files
must hold every accepted sample, and every process must log JSON lines (stderr is a file).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeline.kafka.config import KafkaConfig
from pipeline.replay.rebuild import read_log
from pipeline.samples.archive import read_archive
from topics.names import TopicNames
from topics.records import FinalizedEvent

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.broker, pytest.mark.dataplane]

REPO = Path(__file__).resolve().parents[2]
TOKENTRAIL = f"{sys.executable} -m pipeline.cli"


def walkthrough() -> list[str]:
    text = (REPO / "deploy" / "README.md").read_text()
    section = text.split("## One machine, many processes", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, "the walkthrough's bash block is missing"
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class Operator:
    """Runs walkthrough lines with the README's variables, keeps every process and its log."""

    def __init__(self, root: Path) -> None:
        self.root = root
        kafka_port, worker_port = free_port(), free_port()
        directory = root / "tt-cluster"
        self.env = {
            **os.environ,
            "DIR": str(directory),
            "KAFKA_PORT": str(kafka_port),
            "WORKER_PORT": str(worker_port),
            "KAFKA": f"127.0.0.1:{kafka_port}",
            "PLANE": str(directory / "dataplane.json"),
            "PYTHONPATH": str(REPO),
        }
        self.processes: list[tuple[str, subprocess.Popen[bytes], Path]] = []

    def command(self, line: str) -> str:
        assert line.startswith("tokentrail "), line
        return TOKENTRAIL + line.removeprefix("tokentrail")

    def start(self, line: str) -> subprocess.Popen[bytes]:
        log = self.root / f"{len(self.processes):02d}-{line.split()[1]}.log"
        process = subprocess.Popen(
            ["bash", "-c", f"exec {self.command(line.removesuffix('&').strip())}"],
            cwd=REPO,
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=log.open("wb"),
        )
        self.processes.append((line, process, log))
        return process

    def run(self, line: str, timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-c", self.command(line)],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def stop_all(self) -> None:
        for _, process, _ in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for _, process, _ in self.processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


def wait_for(ready: Any, what: str, within: float = 180.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} not ready within {within:.0f}s")


def port_open(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def worker_healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


async def outcomes(config: KafkaConfig) -> dict[str, set[str]]:
    """Distinct outcomes (everything but the finalize time) per rollout on the finalized topic."""
    found: dict[str, set[str]] = defaultdict(set)
    async for batch, _, _ in read_log(config, [config.names.finalized]):
        for item in batch:
            event = item.event.payload
            assert isinstance(event, FinalizedEvent)
            found[event.rollout_id].add(event.model_dump_json(exclude={"finalized_at"}))
    return found


@pytest.mark.timeout(600)
def test_the_walkthrough_survives_a_killed_replica_of_each_stage(tmp_path: Path) -> None:
    lines = walkthrough()
    assert [line.split("=")[0] for line in lines[:2]] == ["export DIR", "export KAFKA"]
    operator = Operator(tmp_path)
    env = operator.env
    replicas: dict[str, list[subprocess.Popen[bytes]]] = defaultdict(list)
    try:
        for line in lines[2:]:
            verb = line.split()[1]
            if line.endswith("&"):
                process = operator.start(line)
                if verb == "broker":
                    wait_for(lambda: port_open(int(env["KAFKA_PORT"])), "broker")
                elif verb == "dataplane":
                    wait_for(lambda: Path(env["PLANE"]).is_file(), "data plane")
                elif verb == "worker":
                    wait_for(lambda: worker_healthy(int(env["WORKER_PORT"])), "worker")
                    # Started with the minted credentials: its routes want them, so drive needs them too.
                    admin = f"http://127.0.0.1:{env['WORKER_PORT']}/admin/weight_version"
                    assert httpx.get(admin, timeout=5).status_code == 401
                elif verb == "stage":
                    replicas[line.split()[2]].append(process)
                continue
            if verb == "drive":
                drive = subprocess.Popen(
                    ["bash", "-c", operator.command(line)],
                    cwd=REPO,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=(tmp_path / "drive.log").open("wb"),
                    text=True,
                )
                time.sleep(8)  # some rollouts are in flight, some finalized
                for stage in ("ledger", "finalizer"):
                    replicas[stage][0].send_signal(signal.SIGKILL)
                out, _ = drive.communicate(timeout=400)
                assert drive.returncode == 0, (tmp_path / "drive.log").read_text()[-3000:]
                summary = json.loads(out)
                assert summary["rollouts"] == summary["finalized"] == 12 and summary["missing"] == 0, summary
                assert summary["accepted"] == 12 and summary["rejected"] == {}, (
                    summary
                )  # one accepted outcome each
                assert summary["lag"] == 0 and summary["samples_written"] == 12
                continue
            done = operator.run(line, timeout=120)
            assert done.returncode == 0, f"{line}\n{done.stderr[-3000:]}"
            if verb == "lag":
                assert "tokentrail-finalizer" in done.stdout and "tokentrail-ledger" in done.stdout
            if verb == "replay":
                assert json.loads(done.stdout)["differences"] == []

        config = KafkaConfig(env["KAFKA"], names=TopicNames())
        distinct = asyncio.run(outcomes(config))
        driven = {
            r["rollout_id"] for r in read_archive(Path(env["DIR"]) / "driver" / "samples.jsonl").records
        }
        assert len(distinct) == 12 and all(len(copies) == 1 for copies in distinct.values()), distinct
        operator.stop_all()  # the archiver closes its last file on SIGTERM
        archived = {
            r["rollout_id"]
            for path in (Path(env["DIR"]) / "archive").glob("*.jsonl")
            for r in read_archive(path).records
        }
        assert archived == driven
        for line, _, log in operator.processes:
            logged = [text for text in log.read_text().splitlines() if text.strip()]
            records = [json.loads(text) for text in logged if _is_json(text)]
            if line.split()[1] == "worker":  # vLLM's own lines come through the same formatter
                assert any(r["logger"].startswith("vllm") for r in records), logged[:5]
                # Only what libraries write past logging (C++ warnings, progress bars) is not JSON.
                raw = [text for text in logged if not _is_json(text)]
                assert not [text for text in raw if re.search(r"\b(pipeline|stages)\.", text)], raw
            else:
                assert len(records) == len(logged), f"{line}: {logged[:3]}"
    finally:
        operator.stop_all()


def _is_json(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
