"""A capture worker and its rollout driver in one process: the load of the fault suite and the soak.

The worker side is the real capture path (``CaptureCore``, ``PrefixResolver``,
``StagingWriter``) on the real event log and an attached TransferQueue; the engine is a
seeded generator, so every call's tokens are known. Each reply is appended to a truth
file (``{"rollout", "call", "ids", "gen_from", "logprobs"}``) before anything else
happens, so the checker can compare every accepted sample with what the engine made.

Faults it takes part in:

- SIGUSR1: die (SIGKILL) right after the next reply, before its row is staged;
- SIGUSR2: die right after the next batch of rows is written, before its staged events
  are published (mid-batch);
- ``--corrupt-every K``: every Kth rollout's first row is overwritten with one token
  changed once it is staged; the truth file marks the rollout ``corrupted``.

It plays rollouts until the stop file exists, then seals what is in flight and exits 0.
Rollout numbers continue across restarts (``--state``); rollouts in flight when the
process dies are never sealed.

It is no benchmark (it measures nothing) but a process ``bench.cluster`` starts for the
fault suite and ``bench soak``, a process of its own so that a fault can kill it alone.
Its settings can only reach it as arguments, so it keeps its own command line
(argparse) rather than ``bench.command``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench.child import run_child
from pipeline.dataplane import DataPlaneConfig, open_data_plane
from pipeline.dataplane.reattach import ReattachingDataPlane
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.producer import KafkaEventSink
from pipeline.worker.retention import retaining
from stages.capture.cache import ChainCache
from stages.capture.core import AckPolicy, CaptureCore
from stages.capture.resolve import PrefixResolver
from stages.capture.retain import RetainedRows
from stages.capture.writer import StagingWriter
from stages.client import RolloutClient
from stages.ports import DataPlane
from stages.recent import DEFAULT_REMEMBER
from topics.names import TopicNames
from topics.records import CommitCoords, StagedCall, TrainingSample
from topics.staging import CallRow

DIE_AFTER_REPLY = False
DIE_AFTER_PUT = False


def _die_after_reply(signum: int, frame: Any) -> None:
    global DIE_AFTER_REPLY
    DIE_AFTER_REPLY = True


def _die_after_put(signum: int, frame: Any) -> None:
    global DIE_AFTER_PUT
    DIE_AFTER_PUT = True


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class DyingDataPlane:
    """The attached data plane; dies after a put when SIGUSR2 asked for it."""

    def __init__(self, inner: DataPlane) -> None:
        self.inner = inner

    async def put_calls(self, rows: Sequence[CallRow]) -> None:
        await self.inner.put_calls(rows)
        if DIE_AFTER_PUT:
            _die()

    async def get_calls(self, keys: Sequence[str]) -> dict[str, StagedCall]:
        return await self.inner.get_calls(keys)

    async def delete_calls(self, keys: Sequence[str]) -> None:
        await self.inner.delete_calls(keys)

    async def put_samples(self, samples: Sequence[TrainingSample]) -> None:
        await self.inner.put_samples(samples)

    async def get_samples(self, keys: Sequence[str]) -> dict[str, TrainingSample]:
        return await self.inner.get_samples(keys)

    async def delete_samples(self, keys: Sequence[str]) -> None:
        await self.inner.delete_samples(keys)

    async def list_keys(self, partition: str) -> list[str]:
        return await self.inner.list_keys(partition)


class Load:
    def __init__(self, args: argparse.Namespace, core: CaptureCore, client: RolloutClient, plane: DataPlane):
        self.args = args
        self.core = core
        self.client = client
        self.plane = plane
        self.truth = open(args.truth, "ab", buffering=0)  # noqa: SIM115 (lives as long as the process)
        self.next = int(args.state.read_text()) if args.state.exists() else 0

    def _write(self, line: dict[str, Any]) -> None:
        self.truth.write(orjson.dumps(line) + b"\n")

    def _take_number(self) -> int:
        number = self.next
        self.next += 1
        self.args.state.write_text(str(self.next))
        return number

    async def play(self, number: int) -> None:
        args = self.args
        rollout_id = f"s{args.seed}-{number}"
        group = f"g{number // args.group_size}"
        corrupt = args.corrupt_every > 0 and number % args.corrupt_every == args.corrupt_every - 1
        rng = random.Random(f"{args.seed}:{rollout_id}")
        ids: list[int] = []
        coords: CommitCoords | None = None
        for turn in range(rng.randint(2, 4)):
            admission = self.client.admit(rollout_id, coords, group_id=group, call_id=f"c{turn}")
            await self.client.publish_admission(admission)
            prepared = await self.core.prepare(admission)
            prompt = ids + [rng.randrange(3, 30_000) for _ in range(rng.randint(2, 12))]
            output = [rng.randrange(3, 30_000) for _ in range(rng.randint(1, 16))]
            logprobs = np.asarray([-rng.random() * 5 for _ in output], dtype=np.float32).tolist()
            completion = self.core.complete(prepared, prompt, output, logprobs, weight_version=0)
            coords = completion.coords
            self._write(
                {
                    "rollout": rollout_id,
                    "call": admission.call_id,
                    "ids": prompt + output,
                    "gen_from": len(prompt),
                    "logprobs": logprobs,
                    "disposition": coords.disposition,
                }
            )
            if DIE_AFTER_REPLY:
                _die()
            ids = prompt + output
            if corrupt and turn == 0 and coords.disposition == "staged":
                await self._corrupt(coords, rollout_id)
            await asyncio.sleep(args.think_s * rng.uniform(0.5, 1.5))
        await self.client.seal(rollout_id, group_id=group, reward=float(number % 2))
        self._write({"rollout": rollout_id, "sealed": True})

    async def _corrupt(self, coords: CommitCoords, rollout_id: str) -> None:
        """Once the row is staged, flip one generated token in the data plane."""
        for _ in range(100):
            try:
                row = (await self.plane.get_calls([coords.staging_key]))[coords.staging_key]
                ids = list(row.token_ids_delta)
                ids[-1] = ids[-1] + 1
                corrupted = row.model_copy(update={"token_ids_delta": ids})
                await self.plane.put_calls([corrupted])
            except Exception:  # not written yet (or the data plane is down): try again
                await asyncio.sleep(0.02)
                continue
            self._hold_corrupted(corrupted)
            self._write({"rollout": rollout_id, "corrupted": coords.staging_key})
            return

    def _hold_corrupted(self, corrupted: StagedCall) -> None:
        """What the data plane holds now is the corrupted row: the worker's held copy must
        be too (as after any write), so that staging again does not repair it."""
        if self.core.writer.retained is not None:
            self.core.writer.retained.add([corrupted])

    async def run(self) -> None:
        stop = self.args.stop_file

        async def lane() -> None:
            while not stop.exists():
                await self.play(self._take_number())

        await asyncio.gather(*(lane() for _ in range(self.args.concurrency)))


def _announce_restaged(path: Path) -> Callable[[DataPlane], Awaitable[None]]:
    """After the held rows went into a new owner (listeners run in order), write its pid
    where the harness looks before it injects the next fault."""

    async def announce(plane: DataPlane) -> None:
        assert isinstance(plane, ReattachingDataPlane)
        owner = plane.addresses
        await asyncio.to_thread(path.write_text, str(owner.pid if owner is not None else ""))

    return announce


async def main(args: argparse.Namespace) -> None:
    signal.signal(signal.SIGUSR1, _die_after_reply)
    signal.signal(signal.SIGUSR2, _die_after_put)
    kafka = KafkaConfig(
        bootstrap_servers=args.bootstrap,
        names=TopicNames(prefix=args.prefix, partitions=args.partitions),
        client_id=f"loadgen-{os.getpid()}",
    )
    plane_config = DataPlaneConfig(mode="attach", data_dir=args.data_dir, timeout_s=args.dataplane_timeout)
    async with KafkaEventSink(kafka) as sink, open_data_plane(plane_config) as attached:
        plane = DyingDataPlane(attached)
        cache = ChainCache()
        writer = StagingWriter(
            plane,
            sink,
            worker_id=f"loadgen-{os.getpid()}",
            batch_delay_s=0.02,
            retained=RetainedRows(remember=args.remember),
        )
        core = CaptureCore(PrefixResolver(plane, cache), writer, cache, ack_policy=AckPolicy.ENQUEUED)
        writer.start()
        try:
            async with retaining(core, attached, kafka):  # rows survive a data-plane restart
                if isinstance(attached, ReattachingDataPlane):
                    attached.on_reattach(_announce_restaged(args.state.with_name("restaged")))
                await Load(args, core, RolloutClient(sink), plane).run()
        finally:
            await writer.stop()


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--truth", type=Path, required=True)
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--stop-file", type=Path, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--think-s", type=float, default=0.05)
    parser.add_argument("--corrupt-every", type=int, default=0)
    parser.add_argument("--dataplane-timeout", type=float, default=3.0)
    parser.add_argument("--group-size", type=int, default=4, help="rollouts per GRPO group")
    parser.add_argument(
        "--remember", type=int, default=DEFAULT_REMEMBER, help="finalized rollouts remembered"
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    run_child(main(parse()))
