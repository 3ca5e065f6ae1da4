"""The pipeline as separate processes under a steady load: the soak's and the fault suite's cluster.

A ``Cluster`` runs the embedded broker (in this process, so its tansu child can be
killed and a new broker started on the same port and store), the data-plane owner, the
ledger and finalizer stages, a capture worker with its driver (``loadgen.py``) and, if
asked, the samples' owner (``sample_owner.py``) as child processes. It supervises them
as an orchestrator would: a process that dies on its own (the finalizer when the data
plane stops answering) is started again. The fault suite injects its faults into it;
``tokentrail bench soak`` watches it for hours.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pipeline.dataplane.addresses import AddressesError, DataPlaneAddresses
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.embedded.broker import EmbeddedBroker, free_port
from pipeline.kafka.lag import LagReader
from pipeline.process.flags import to_argv
from pipeline.replay.rebuild import read_log
from pipeline.stagehost.lag import StageLagProbe
from pipeline.stagehost.settings import StageHostSettings, StageName
from topics.names import TopicNames

# Well past the longest stall the faults cause a worker's staged events (a data-plane stop
# then an owner kill: a few 3 s timeouts in a row), so that no grace decision sits on its
# boundary, where the live ledger and a replay can still decide differently (README).
SEAL_GRACE_S = 30.0
MAX_OPEN_S = 8.0
DATAPLANE_TIMEOUT_S = 3.0
STAGING_SWEEP_S = 2.0
"""The finalizer's janitor sweeps this often here (60 s by default), so a run ends clean."""


@dataclass
class Proc:
    """A supervised child process; ``ensure`` starts it again if it died on its own."""

    name: str
    argv: list[str]
    log: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    finished: bool = False

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                self.proc.wait(timeout=30)

    def ensure(self) -> bool:
        """Start again after an exit, unless it finished its work (exit 0 of a job); True if restarted."""
        if self.proc is None or self.alive() or self.finished:
            return False
        if self.proc.returncode == 0 and self.name == "worker":
            self.finished = True
            return False
        self.restarts += 1
        time.sleep(0.5)  # an orchestrator backs off too
        self.start()
        return True


@dataclass
class Cluster:
    """``storage="durable"`` is needed to survive a broker kill, but tansu's durable engine
    serves only about 20 record batches a second to consumers (measured), so a durable
    cluster runs a light load; a memory one a heavier load and every other fault."""

    root: Path
    seed: int
    storage: str = "memory"
    concurrency: int = 6
    think_s: float = 0.05
    max_open_s: float = MAX_OPEN_S
    remember: int = 100_000
    retain_bytes: int | None = None
    """The finalizer's budget for sample copies (None: its default)."""
    closed_budget_mib: float | None = None
    """The ledger's budget for closed rollouts' call ids (None: its default)."""
    fetch_wait_ms: int | None = None
    """The stages' fetch wait (None: their default)."""
    group_size: int = 4
    """Rollouts per GRPO group, in the driver's numbering and the sample owner's feed."""
    sample_owner: bool = False
    """Run a trainer feed that takes and acknowledges every sample (``bench.sample_owner``);
    without one the data plane keeps every sample (the fault suite checks them there)."""
    names: TopicNames = field(init=False)
    broker: EmbeddedBroker = field(init=False)
    procs: dict[str, Proc] = field(default_factory=dict)
    metrics_ports: dict[str, int] = field(default_factory=dict)
    """Each stage's ``/metrics`` port, by stage name."""
    dataplane_restarts: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.names = TopicNames(prefix=f"f{self.seed}", partitions=4)
        self.port = free_port()
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        self.truth = self.root / "truth.jsonl"
        self.stop_file = self.root / "stop"

    @property
    def kafka(self) -> KafkaConfig:
        return self.broker.kafka_config(self.names, client_id="faults")

    # -- processes ----------------------------------------------------------------

    def _start_broker(self) -> None:
        durable = self.storage == "durable"
        self.broker = EmbeddedBroker(
            storage="durable" if durable else "memory",
            data_dir=self.root / "broker" if durable else None,
            port=self.port,
            startup_timeout=60,
        ).start()

    def _proc(self, name: str, argv: list[str]) -> Proc:
        env = {**os.environ, "TOKENTRAIL_DATAPLANE_TIMEOUT_S": str(DATAPLANE_TIMEOUT_S)}
        proc = Proc(name, argv, self.root / "logs" / f"{name}.log", env)
        self.procs[name] = proc
        proc.start()
        return proc

    def _cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "pipeline.cli", *args]

    def _stage(self, name: StageName) -> list[str]:
        bounds = {
            field: value
            for field, value in (
                ("retain_samples_bytes", self.retain_bytes),
                ("closed_budget_mib", self.closed_budget_mib),
                ("fetch_wait_ms", self.fetch_wait_ms),
            )
            if value is not None
        }
        settings = StageHostSettings(
            name=name,
            metrics_port=self.metrics_ports.setdefault(name, free_port()),
            seal_grace_s=SEAL_GRACE_S,
            max_open_s=self.max_open_s,
            session_timeout_ms=1000,
            heartbeat_ms=300,
            dataplane_mode="attach",
            data_dir=self.root,
            remember=self.remember,
            staging_sweep_s=STAGING_SWEEP_S,
            **bounds,
        )
        return self._cli(
            "stage", *to_argv(settings), "--bootstrap", self.broker.bootstrap,
            "--topic-prefix", self.names.prefix, "--partitions", str(self.names.partitions),
        )  # fmt: skip

    def _worker(self) -> list[str]:
        return [
            sys.executable, "-m", "bench.loadgen", "--bootstrap", self.broker.bootstrap,
            "--prefix", self.names.prefix, "--partitions", str(self.names.partitions),
            "--data-dir", str(self.root), "--truth", str(self.truth), "--state", str(self.root / "next"),
            "--stop-file", str(self.stop_file), "--seed", str(self.seed), "--corrupt-every", "11",
            "--dataplane-timeout", str(DATAPLANE_TIMEOUT_S), "--concurrency", str(self.concurrency),
            "--think-s", str(self.think_s), "--remember", str(self.remember),
            "--group-size", str(self.group_size),
        ]  # fmt: skip

    def _sample_owner(self) -> list[str]:
        return [
            sys.executable, "-m", "bench.sample_owner", "--bootstrap", self.broker.bootstrap,
            "--prefix", self.names.prefix, "--partitions", str(self.names.partitions),
            "--data-dir", str(self.root), "--group-size", str(self.group_size),
            "--dataplane-timeout", str(DATAPLANE_TIMEOUT_S),
        ]  # fmt: skip

    def start(self) -> None:
        self._start_broker()
        asyncio.run(ensure_topics(self.kafka))
        self._proc("dataplane", self._cli("dataplane", "--data-dir", str(self.root)))
        self._wait_dataplane(self.procs["dataplane"].pid)
        self._proc("ledger", self._stage("ledger"))
        self._proc("finalizer", self._stage("finalizer"))
        if self.sample_owner:
            self._proc("owner", self._sample_owner())
        self._proc("worker", self._worker())
        self.wait_flowing()

    def wait_flowing(self, within_s: float = 120) -> None:
        """Until the first rollout is finalized: every process is up and connected."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            self.supervise(1.0)
            if asyncio.run(_events_on(self.kafka, self.names.finalized)):
                return
        raise TimeoutError(f"no rollout finalized within {within_s:g}s (logs in {self.root / 'logs'})")

    def _wait_dataplane(self, pid: int, within_s: float = 90) -> None:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            with contextlib.suppress(AddressesError):
                if DataPlaneAddresses.read(self.root / "dataplane.json").pid == pid:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"the data plane (pid {pid}) did not publish its addresses")

    def supervise(self, seconds: float) -> None:
        """Keep every process up for ``seconds``, as an orchestrator would."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for proc in self.procs.values():
                code = proc.proc.returncode if proc.proc is not None else None
                if proc.ensure():
                    self.note(f"restarted {proc.name} (it exited with {code})")
            self.broker.check()
            time.sleep(0.2)

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.finished = True
            with contextlib.suppress(Exception):
                proc.kill(signal.SIGTERM)
        with contextlib.suppress(Exception):
            self.broker.stop()

    def note(self, what: str) -> None:
        with (self.root / "logs" / "timeline.log").open("a") as out:
            out.write(f"{time.strftime('%H:%M:%S')} {what}\n")

    def played(self) -> int:
        """Rollouts the worker has started so far (its state file)."""
        state = self.root / "next"
        return int(state.read_text() or 0) if state.exists() else 0

    def wait_progress(self, rollouts: int, within_s: float = 90) -> None:
        """Supervise until the worker has started ``rollouts`` more rollouts."""
        target = self.played() + rollouts
        deadline = time.monotonic() + within_s
        while self.played() < target:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the worker did not start {rollouts} rollouts within {within_s:g}s")
            self.supervise(1.0)

    def drain(self, within_s: float = 120) -> None:
        """Stop the load, then supervise until every admitted rollout has an outcome and lag is 0."""
        self.stop_file.touch()
        deadline = time.monotonic() + within_s
        waiting = "the worker is still running"
        while time.monotonic() < deadline:
            self.supervise(2.0)
            if self.procs["worker"].alive():
                continue
            waiting = asyncio.run(unsettled(self.kafka))
            if not waiting:
                return
        raise TimeoutError(
            f"the pipeline did not settle within {within_s:g}s: {waiting} (logs in {self.root / 'logs'})"
        )


def events_on(config: KafkaConfig, topic: str) -> int:
    """How many events ``topic`` holds."""
    return asyncio.run(_events_on(config, topic))


async def _events_on(config: KafkaConfig, topic: str) -> int:
    async with LagReader(config) as reader:
        marks = await reader.watermarks(await reader.partitions([topic]))
    return sum(m.highwater - m.log_start for m in marks.values())


def group_lags(config: KafkaConfig) -> dict[str, int]:
    """Consumer lag of every stage, by stage name."""
    return asyncio.run(_group_lags(config))


async def _group_lags(config: KafkaConfig) -> dict[str, int]:
    async with StageLagProbe(config) as probe:
        return await probe.read()


async def unsettled(config: KafkaConfig) -> str:
    """What the pipeline still owes: consumer lag, or admitted rollouts without an outcome."""
    for stage, lag in (await _group_lags(config)).items():
        if lag:
            return f"{stage} lags by {lag}"
    admitted = {r async for r in _keys(config, config.names.admission)}
    finalized = {r async for r in _keys(config, config.names.finalized)}
    missing = sorted(admitted - finalized)
    return f"{len(missing)} admitted rollouts without an outcome: {missing[:5]}" if missing else ""


async def _keys(config: KafkaConfig, topic: str) -> Any:
    async for events, _, _ in read_log(config, [topic]):
        for item in events:
            yield item.event.key


ClusterT = TypeVar("ClusterT", bound=Cluster)


@contextlib.contextmanager
def running(cluster: ClusterT) -> Iterator[ClusterT]:
    """The cluster started, and stopped on the way out however the block ends."""
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
