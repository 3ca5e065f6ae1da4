"""The fault harness: faults injected into the pipeline's processes, and the invariants checked after.

The processes and their load are ``bench.cluster``'s (the soak benchmark runs the same
cluster); this adds the faults an orchestrator's world throws at them, and ``check``,
which reads everything back and lists every broken invariant.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiokafka import AIOKafkaProducer

from bench import cluster as base
from bench.cluster import DATAPLANE_TIMEOUT_S, SEAL_GRACE_S, STAGING_SWEEP_S, events_on, group_lags, running
from pipeline.dataplane import DataPlaneConfig, open_data_plane
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.lag import LagReader
from pipeline.kafka.reader import assigned_reader
from pipeline.replay.rebuild import compare, materialize, read_log, rebuild
from pipeline.replay.store import LedgerStore
from stages.ledger.stage import LedgerConfig
from stages.ports import STAGING_PARTITION, MissingRows
from topics.digest import cumulative_hash
from topics.records import CaptureAdmission, FinalizedEvent, RolloutSeal, TrainingSample

__all__ = ["events_on", "group_lags"]

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
class Cluster(base.Cluster):
    """The soak's cluster, with faults to inject into it."""

    injected: Counter[str] = field(default_factory=Counter)

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
    with running(Cluster(root, seed, **options)) as cluster:
        yield cluster


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
