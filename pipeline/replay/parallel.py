"""Replay in parallel: the log's partitions rebuilt apart, one shard per process.

A rollout's events all lie in one partition number of every input topic (they share the
key partitioner), and the ledger keeps its clock per partition (DESIGN §7.1), so what
it decides for partition *p* depends on partition *p* alone: the live ledger's group
members already own partitions apart. Shard *i* of *n* (``Shard``) rebuilds the
partitions with ``p % n == i`` in a process of its own, into a SQLite file of its own;
the files are merged into the output store once every shard is done.

Crash-only: the shards die with the replay, also on SIGKILL (``guard_descendants``),
and a shard that fails or dies fails the replay naming it. The output is a rebuildable
copy of the log, so running the replay again is the recovery.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from aiokafka import TopicPartition

from pipeline.kafka.config import ConfigError, KafkaConfig
from pipeline.kafka.lag import LagReader
from pipeline.process.guard import guard_descendants
from pipeline.process.heap import collect_per_batch
from pipeline.replay.rebuild import Progress, ReplayResult, Shard, rebuild
from pipeline.replay.store import LedgerStore
from stages.ledger.stage import LedgerConfig
from stages.specs import LEDGER

POLL_S = 0.05
"""How often the replay looks at its shards (results, exits, progress)."""


class ShardFailed(RuntimeError):
    """A shard raised or died; the replay's output is incomplete and must be rebuilt."""


@dataclass(frozen=True, slots=True)
class _Job:
    """What one shard process needs (pickled to it)."""

    config: KafkaConfig
    ledger: LedgerConfig
    start: dict[TopicPartition, int] | None
    shard: Shard
    out: Path


async def rebuild_parallel(
    config: KafkaConfig,
    store: LedgerStore,
    *,
    processes: int,
    ledger: LedgerConfig | None = None,
    start: Mapping[TopicPartition, int] | None = None,
    progress: Progress | None = None,
) -> ReplayResult:
    """``rebuild`` in ``processes`` shard processes (in this one for 1), merged into ``store``."""
    if processes < 1:
        raise ValueError(f"processes: at least 1, not {processes}")
    if processes == 1:
        return await rebuild(config, store, ledger=ledger, start=start, progress=progress)
    await check_shardable(config, LEDGER.inputs(config.names))
    guard_descendants(role="replay")
    context = multiprocessing.get_context("spawn")
    counters: Any = context.Array("q", 2 * processes, lock=False)  # done, total per shard
    with tempfile.TemporaryDirectory(prefix="tokentrail-replay-") as scratch:
        jobs = [
            _Job(
                config,
                ledger or LedgerConfig(),
                dict(start) if start is not None else None,
                Shard(index, processes),
                Path(scratch) / f"shard-{index}.sqlite",
            )
            for index in range(processes)
        ]
        shards: list[tuple[BaseProcess, Connection]] = []
        try:
            for job in jobs:
                receiver, sender = context.Pipe(duplex=False)
                process = context.Process(
                    target=_run_shard,
                    args=(job, counters, sender),
                    name=f"tokentrail-replay-{job.shard.index}",
                    daemon=True,
                )
                process.start()
                sender.close()
                shards.append((process, receiver))
            results = await _collect(shards, counters, progress)
        finally:
            for started, receiver in shards:
                if started.is_alive():
                    started.kill()
                started.join()
                receiver.close()
        for job in jobs:
            store.merge(job.out)
    return ReplayResult(
        events=sum(r.events for r in results),
        undecodable=sum(r.undecodable for r in results),
        stored=store.counts(),
        open_rollouts=sum(r.open_rollouts for r in results),
    )


async def check_shardable(config: KafkaConfig, topics: Sequence[str]) -> None:
    """Refuse topics whose partition counts differ: a rollout's events would then not
    share a partition number, and no shard would hold all of them."""
    async with LagReader(config) as reader:
        partitions = await reader.partitions(topics)
    counts = {topic: sum(1 for tp in partitions if tp.topic == topic) for topic in topics}
    if len(set(counts.values())) > 1:
        raise ConfigError(
            f"processes: the input topics have different partition counts ({counts}); "
            "replay them in one process"
        )


async def _collect(
    shards: Sequence[tuple[BaseProcess, Connection]], counters: Any, progress: Progress | None
) -> list[ReplayResult]:
    """Every shard's result, in shard order, reporting progress on the way."""
    results: dict[int, ReplayResult] = {}
    while len(results) < len(shards):
        for index, (process, receiver) in enumerate(shards):
            if index in results:
                continue
            if receiver.poll():  # an answer, or the end of the pipe: the shard is gone
                try:
                    answer = receiver.recv()
                except EOFError:
                    raise _died(index, len(shards), process) from None
                if isinstance(answer, str):
                    raise ShardFailed(f"replay shard {index} of {len(shards)} failed: {answer}")
                results[index] = answer
            elif not process.is_alive():
                raise _died(index, len(shards), process)
        if progress is not None:
            progress(sum(counters[0::2]), sum(counters[1::2]))
        if len(results) < len(shards):
            await asyncio.sleep(POLL_S)
    return [results[index] for index in range(len(shards))]


def _died(index: int, count: int, process: BaseProcess) -> ShardFailed:
    process.join(timeout=5)  # its exit code
    return ShardFailed(
        f"replay shard {index} of {count} exited with code {process.exitcode} before it finished; "
        "run the replay again"
    )


def _run_shard(job: _Job, counters: Any, answer: Connection) -> None:
    """A shard process: rebuild its partitions into its own file, send the result (or
    why not) back."""
    slot = 2 * job.shard.index

    def progress(done: int, total: int) -> None:
        counters[slot], counters[slot + 1] = done, total

    collect_per_batch()
    try:
        with LedgerStore(job.out) as store:
            result = asyncio.run(
                rebuild(
                    job.config, store, ledger=job.ledger, start=job.start, progress=progress, shard=job.shard
                )
            )
    except Exception as exc:  # the replay reports it, naming the shard
        answer.send(f"{type(exc).__name__}: {exc}")
    else:
        answer.send(result)
    finally:
        answer.close()
