"""The fault harness: the pipeline as separate processes, faults injected into them.

A ``Cluster`` runs the embedded broker in durable mode (in this process, so its tansu
child can be killed and a new broker started on the same port and store), the
data-plane owner, the ledger and finalizer stages and a capture worker with its driver
(``loadgen.py``) as child processes. It supervises them as an orchestrator would: a
process that dies on its own (the finalizer when the data plane stops answering) is
started again. ``check`` then reads everything back and lists every broken invariant.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiokafka import AIOKafkaProducer

from pipeline.dataplane import DataPlaneConfig, open_data_plane
from pipeline.dataplane.addresses import AddressesError, DataPlaneAddresses
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.broker import EmbeddedBroker, free_port
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.lag import LagReader
from pipeline.kafka.reader import assigned_reader
from pipeline.replay.rebuild import compare, materialize, read_log, rebuild
from pipeline.replay.store import LedgerStore
from pipeline.stagehost.lag import StageLagProbe
from stages.ledger.stage import LedgerConfig
from stages.ports import STAGING_PARTITION, MissingRows
from topics.digest import cumulative_hash
from topics.names import TopicNames
from topics.records import CaptureAdmission, FinalizedEvent, RolloutSeal, TrainingSample

HERE = Path(__file__).resolve().parent
# Well past the longest stall the faults cause a worker's staged events (a data-plane stop
# then an owner kill: a few 3 s timeouts in a row), so that no grace decision sits on its
# boundary, where the live ledger and a replay can still decide differently (README).
SEAL_GRACE_S = 30.0
MAX_OPEN_S = 8.0
DATAPLANE_TIMEOUT_S = 3.0
STAGING_SWEEP_S = 2.0
"""The finalizer's janitor sweeps this often here (60 s by default), so a run ends clean."""
BROKER_KILL = "broker killed (durable)"
FAULTS = (
    "ledger killed",
    "finalizer killed",
    "worker killed between reply and staging",
    "worker killed mid-batch",
    "data plane stops answering",
    "data-plane owner killed",
    "segment delivered twice, reordered",
)


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
    names: TopicNames = field(init=False)
    broker: EmbeddedBroker = field(init=False)
    procs: dict[str, Proc] = field(default_factory=dict)
    dataplane_restarts: list[float] = field(default_factory=list)
    injected: Counter[str] = field(default_factory=Counter)

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

    def _stage(self, name: str) -> list[str]:
        return self._cli(
            "stage", name, "--bootstrap", self.broker.bootstrap, "--topic-prefix", self.names.prefix,
            "--partitions", str(self.names.partitions), "--seal-grace", str(SEAL_GRACE_S),
            "--max-open", str(self.max_open_s), "--session-timeout-ms", "1000", "--heartbeat-ms", "300",
            "--dataplane-mode", "attach", "--data-dir", str(self.root), "--remember", str(self.remember),
            "--staging-sweep", str(STAGING_SWEEP_S),
            *(("--retain-samples-bytes", str(self.retain_bytes)) if self.retain_bytes is not None else ()),
        )  # fmt: skip

    def _worker(self) -> list[str]:
        return [
            sys.executable, str(HERE / "loadgen.py"), "--bootstrap", self.broker.bootstrap,
            "--prefix", self.names.prefix, "--partitions", str(self.names.partitions),
            "--data-dir", str(self.root), "--truth", str(self.truth), "--state", str(self.root / "next"),
            "--stop-file", str(self.stop_file), "--seed", str(self.seed), "--corrupt-every", "11",
            "--dataplane-timeout", str(DATAPLANE_TIMEOUT_S), "--concurrency", str(self.concurrency),
            "--think-s", str(self.think_s),
        ]  # fmt: skip

    def start(self) -> None:
        self._start_broker()
        asyncio.run(ensure_topics(self.kafka))
        self._proc("dataplane", self._cli("dataplane", "--data-dir", str(self.root)))
        self._wait_dataplane(self.procs["dataplane"].pid)
        self._proc("ledger", self._stage("ledger"))
        self._proc("finalizer", self._stage("finalizer"))
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

    def _wait_restaged(self, owner_pid: int, worker_pid: int | None, within_s: float = 60) -> None:
        """Until the worker has staged its held rows into the new owner (or was restarted
        and holds none): a second fault before that would be a double fault."""
        announced = self.root / "restaged"
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if announced.exists() and announced.read_text() == str(owner_pid):
                return
            worker = self.procs["worker"]
            if worker_pid is None or not worker.alive() or worker.pid != worker_pid:
                return  # restarted since: it holds no rows of the old owner
            self.supervise(0.2)
        raise TimeoutError(
            f"the worker did not stage its rows into the new owner (logs in {self.root / 'logs'})"
        )

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

    # -- faults -------------------------------------------------------------------

    def note(self, what: str) -> None:
        with (self.root / "logs" / "timeline.log").open("a") as out:
            out.write(f"{time.strftime('%H:%M:%S')} {what}\n")

    def inject(self, fault: str, rng: random.Random) -> None:
        self.injected[fault] += 1
        self.note(f"inject: {fault}")
        if fault == "ledger killed":
            self.procs["ledger"].kill()
        elif fault == "finalizer killed":
            self.procs["finalizer"].kill()
        elif fault == "worker killed between reply and staging":
            self.procs["worker"].kill(signal.SIGUSR1)
        elif fault == "worker killed mid-batch":
            self.procs["worker"].kill(signal.SIGUSR2)
        elif fault == "broker killed (durable)":
            if self.storage != "durable":
                raise ValueError("a broker kill needs a durable broker")
            os.kill(self.broker.pid, signal.SIGKILL)
            time.sleep(rng.uniform(0.5, 2.0))
            self.broker.stop()
            self._start_broker()
        elif fault == "data plane stops answering":
            owner = self.procs["dataplane"]
            owner.kill(signal.SIGSTOP)
            self.supervise(DATAPLANE_TIMEOUT_S + rng.uniform(1.0, 3.0))
            owner.kill(signal.SIGCONT)
        elif fault == "data-plane owner killed":
            owner, worker = self.procs["dataplane"], self.procs["worker"]
            worker_pid = worker.pid if worker.alive() else None
            owner.kill()
            owner.start()
            self._wait_dataplane(owner.pid)
            self.dataplane_restarts.append(time.time())  # workers and the finalizer re-attach
            self._wait_restaged(owner.pid, worker_pid)
        elif fault == "segment delivered twice, reordered":
            asyncio.run(redeliver(self.kafka, [self.names.admission, self.names.staged], rng))
        else:
            raise ValueError(f"fault: unknown {fault!r}")

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


async def redeliver(config: KafkaConfig, topics: list[str], rng: random.Random) -> int:
    """Append a recent segment of each partition of ``topics`` to itself again, shuffled."""
    async with LagReader(config) as reader:
        partitions = await reader.partitions(topics)
        marks = await reader.watermarks(partitions)
    producer = AIOKafkaProducer(**config.client_kwargs(), acks="all")
    await producer.start()
    copied = 0
    try:
        for tp in partitions:
            end = marks[tp].highwater
            length = rng.randint(10, 60)
            start = max(marks[tp].log_start, end - length - rng.randint(0, 200))
            if end <= start:
                continue
            records: list[Any] = []
            async with assigned_reader(config, {tp: start}) as consumer:
                while len(records) < min(length, end - start):
                    fetched = await consumer.getmany(tp, timeout_ms=1000)
                    if not fetched:
                        break
                    records += [r for batch in fetched.values() for r in batch]
            records = records[:length]
            rng.shuffle(records)
            batch = producer.create_batch()
            for record in records:
                batch.append(key=record.key, value=record.value, timestamp=None, headers=list(record.headers))
            await (await producer.send_batch(batch, tp.topic, partition=tp.partition))
            copied += len(records)
    finally:
        await producer.stop()
    return copied


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


# -- invariants -------------------------------------------------------------------


@dataclass
class Verdict:
    problems: list[str] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    samples_checked: int = 0
    samples_lost_with_dataplane: int = 0
    corrupted: int = 0
    rollouts: int = 0

    def summary(self) -> str:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items()))
        return f"{self.rollouts} rollouts: {reasons}"


@dataclass
class _Truth:
    calls: list[dict[str, Any]] = field(default_factory=list)
    corrupted: bool = False


def read_truth(path: Path) -> dict[str, _Truth]:
    truth: dict[str, _Truth] = defaultdict(_Truth)
    for line in path.read_bytes().splitlines():
        item = orjson.loads(line)
        entry = truth[item["rollout"]]
        if "call" in item:
            entry.calls.append(item)
        elif "corrupted" in item:
            entry.corrupted = True
    return truth


def expected_sample(calls: list[dict[str, Any]]) -> tuple[list[int], list[float], list[float]]:
    """Ids, mask and logprobs of a linear rollout as the engine produced them."""
    ids: list[int] = calls[-1]["ids"]
    mask = [0.0] * len(ids)
    logprobs = [0.0] * len(ids)
    for call in calls:
        for offset, logprob in enumerate(call["logprobs"]):
            mask[call["gen_from"] + offset] = 1.0
            logprobs[call["gen_from"] + offset] = logprob
    return ids, mask, logprobs


def check(cluster: Cluster) -> Verdict:
    return asyncio.run(_check(cluster))


async def _check(cluster: Cluster) -> Verdict:
    config = cluster.kafka
    names = config.names
    verdict = Verdict()
    truth = read_truth(cluster.truth)
    admitted: set[str] = set()
    async for events, _, _ in read_log(config, [names.admission]):
        admitted |= {
            i.event.key for i in events if isinstance(i.event.payload, CaptureAdmission | RolloutSeal)
        }
    outcomes: dict[str, dict[str, FinalizedEvent]] = defaultdict(dict)
    async for events, _, _ in read_log(config, [names.finalized]):
        for item in events:
            event = item.event.payload
            assert isinstance(event, FinalizedEvent)
            signature = event.model_dump_json(exclude={"finalized_at"})
            outcomes[event.rollout_id][signature] = event
    verdict.rollouts = len(admitted)
    for rollout_id in sorted(admitted):
        distinct = list(outcomes.get(rollout_id, {}).values())
        if len(distinct) != 1:
            verdict.problems.append(f"{rollout_id}: {len(distinct)} distinct outcomes")
            continue
        event = distinct[0]
        verdict.outcomes[event.status if event.status == "accepted" else str(event.rejection_reason)] += 1
    plane_config = DataPlaneConfig(mode="attach", data_dir=cluster.root, timeout_s=30)
    async with open_data_plane(plane_config) as plane:
        for rollout_id, by_signature in outcomes.items():
            event = next(iter(by_signature.values()))
            verdict.problems += await _check_sample(plane, event, truth.get(rollout_id), cluster, verdict)
        leftover = await _staging_left(plane)
        if leftover:
            verdict.problems.append(f"{len(leftover)} staging rows left after the drain: {leftover[:5]}")
    with (
        LedgerStore(cluster.root / "rebuilt.sqlite") as rebuilt,
        LedgerStore(cluster.root / "live.sqlite") as live,
    ):
        await rebuild(
            config, rebuilt, ledger=LedgerConfig(seal_grace_s=SEAL_GRACE_S, max_open_s=cluster.max_open_s)
        )
        await materialize(config, live)
        differences = compare(rebuilt, live)
        if differences:
            verdict.problems.append(f"rebuilt ledger differs from the live one: {differences[:5]}")
            verdict.problems += _explain(rebuilt.snapshot(), live.snapshot(), differences[:3])
    verdict.corrupted = sum(1 for t in truth.values() if t.corrupted)
    return verdict


async def _staging_left(plane: Any) -> list[str]:
    """Staging keys still there once the finalizer's janitor has swept at least twice more:
    every rollout is finalized by now, so nothing may stay (DESIGN §7.3)."""
    deadline = time.monotonic() + 3 * STAGING_SWEEP_S
    while True:
        left: list[str] = await plane.list_keys(STAGING_PARTITION)
        if not left or time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.5)


def _explain(rebuilt: dict[str, bytes], live: dict[str, bytes], differences: list[str]) -> list[str]:
    """The fields in which rebuilt and live copies of an event differ."""
    lines = []
    for line in differences:
        event_id = line.split(": ", 1)[1]
        if event_id in rebuilt and event_id in live:
            a, b = orjson.loads(rebuilt[event_id]), orjson.loads(live[event_id])
            fields = {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
            lines.append(f"  {event_id} (rebuilt, live): {str(fields)[:600]}")
    return lines


async def _check_sample(
    plane: Any, event: FinalizedEvent, truth: _Truth | None, cluster: Cluster, verdict: Verdict
) -> list[str]:
    rollout_id = event.rollout_id
    try:
        sample: TrainingSample | None = (await plane.get_samples([rollout_id]))[rollout_id]
    except MissingRows:
        sample = None
    if event.status == "rejected":
        return (
            [f"{rollout_id}: rejected ({event.rejection_reason}) but its sample is stored"] if sample else []
        )
    if truth is not None and truth.corrupted:
        return [f"{rollout_id}: a corrupted row was accepted"]
    if sample is None:
        if any(event.finalized_at < restart for restart in cluster.dataplane_restarts):
            verdict.samples_lost_with_dataplane += 1
            return []
        return [f"{rollout_id}: accepted but no sample in the data plane"]
    if truth is None or not truth.calls:
        return [f"{rollout_id}: accepted but the engine never answered it"]
    ids, mask, logprobs = expected_sample(truth.calls)
    verdict.samples_checked += 1
    problems = []
    if sample.token_ids != ids:
        problems.append(f"{rollout_id}: sample ids differ from the engine's")
    if sample.token_mask != mask or sample.logprobs != logprobs:
        problems.append(f"{rollout_id}: sample mask or logprobs differ from the engine's")
    if sample.cumulative_hash != cumulative_hash(ids):
        problems.append(f"{rollout_id}: sample digest does not verify")
    return problems


@contextlib.contextmanager
def running_cluster(root: Path, seed: int, **options: Any) -> Iterator[Cluster]:
    cluster = Cluster(root, seed, **options)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def schedule(seed: int, spacing_s: float = 4.0) -> list[tuple[float, str]]:
    """Every fault once, in a seed-dependent order, at seed-dependent times."""
    rng = random.Random(seed)
    order = list(FAULTS)
    rng.shuffle(order)
    at = 6.0
    plan = []
    for fault in order:
        plan.append((at, fault))
        at += spacing_s * rng.uniform(0.7, 1.3)
    return plan
