"""Captured rollouts for the pipeline benchmark: real rows and the events that name them.

Every call goes through the real capture path (``RolloutClient`` admissions, a
``CaptureCore`` on in-memory ports, ``topics.staging.staging_row`` / ``build_delta`` inside
it), so rows carry real digests and chain hashes and the finalizer verifies them as it
would in production. Built once per rollout length and reused: the rows go back into
the data plane before each configuration, because the finalizer deletes them.
"""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from dataclasses import dataclass

from stages.capture.cache import ChainCache
from stages.capture.core import AckPolicy, CaptureCore
from stages.capture.resolve import PrefixResolver
from stages.capture.writer import StagingWriter
from stages.client import RolloutClient
from stages.memory import MemoryDataPlane, RecordingSink
from topics.records import CaptureAdmission, CommitCoords, Record, RolloutSeal, StagedCall, StagedEvent


@dataclass(frozen=True, slots=True)
class Rollout:
    """One captured rollout: its call events (admissions and staged), its seal, its rows."""

    rollout_id: str
    events: list[Record]
    seal: RolloutSeal
    rows: list[StagedCall]

    @property
    def calls(self) -> int:
        return len(self.rows)


async def capture_rollouts(
    tag: str, count: int, length: int, *, new_tokens: int = 16, generated: int = 16, seed: int = 0
) -> list[Rollout]:
    """``count`` rollouts of ``length`` token-in calls each; every call adds ``new_tokens``
    prompt tokens and ``generated`` generated ones to the exact ids before it."""
    plane, sink = MemoryDataPlane(), RecordingSink()
    cache = ChainCache()
    writer = StagingWriter(plane, sink, worker_id="bench-capture", batch_delay_s=0.0)
    core = CaptureCore(PrefixResolver(plane, cache), writer, cache, ack_policy=AckPolicy.ENQUEUED)
    client = RolloutClient(sink)
    rng = random.Random(seed)
    writer.start()
    ids_of: list[str] = []
    for number in range(count):
        rollout_id = f"{tag}-{number}"
        ids_of.append(rollout_id)
        ids: list[int] = []
        coords: CommitCoords | None = None
        for turn in range(length):
            admission = client.admit(rollout_id, coords, group_id=tag, call_id=f"c{turn}")
            await client.publish_admission(admission)
            prompt = ids + [rng.randrange(3, 50_000) for _ in range(new_tokens)]
            output = [rng.randrange(3, 50_000) for _ in range(generated)]
            logprobs = [-rng.random() * 4 for _ in range(generated)]
            prepared = await core.prepare(admission)
            coords = core.complete(prepared, prompt, output, logprobs, weight_version=1).coords
            ids = prompt + output
        await client.seal(rollout_id, group_id=tag, reward=1.0)
        if number % 64 == 63:
            await asyncio.sleep(0)  # let the writer keep up
    await writer.stop()
    return _group(ids_of, sink, plane)


def _group(rollout_ids: list[str], sink: RecordingSink, plane: MemoryDataPlane) -> list[Rollout]:
    events: dict[str, list[Record]] = defaultdict(list)
    seals: dict[str, RolloutSeal] = {}
    for envelope in sink.events:
        payload = envelope.payload
        if isinstance(payload, RolloutSeal):
            seals[payload.rollout_id] = payload
        elif isinstance(payload, CaptureAdmission | StagedEvent):
            events[envelope.key].append(payload)
    rows: dict[str, list[StagedCall]] = defaultdict(list)
    for row in plane.calls.values():
        rows[row.rollout_id].append(row)
    failed = [
        e
        for e in sink.events
        if isinstance(e.payload, StagedEvent) and e.payload.coords.disposition != "staged"
    ]
    if failed:
        raise RuntimeError(f"{len(failed)} call(s) failed to capture while building the fixture")
    return [Rollout(r, events[r], seals[r], rows[r]) for r in rollout_ids]


__all__ = ["Rollout", "capture_rollouts"]
