"""Ledger memory: bytes held per open rollout, and what finished rollouts leave behind.

DESIGN §9 asks for memory that is constant per open rollout and does not grow with
finished rollouts. The events are encoded first and decoded inside the measured region,
as the consumer loop decodes them, so the decoded events the ledger keeps are counted
(``tracemalloc``: Python allocations only, which is all the ledger makes). Then every
rollout is sealed and the consumer's commit point moved past them: what is still held
afterwards is what finished rollouts cost.
"""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from collections.abc import Sequence
from typing import Any

from bench.events import rollout_events
from stages.ledger.stage import LedgerStage
from stages.ports import Consumed
from topics.codec import decode, encode_record
from topics.records import Record, RolloutSeal

TOPIC = "admission"


class _Discard:
    """The ledger's output sink: outputs are dropped (only the ledger's own state is measured)."""

    async def publish(self, records: Sequence[Record]) -> None:
        del records


def _encoded(events: Sequence[Record]) -> list[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
    return [encode_record(event) for event in events]


async def _feed(
    stage: LedgerStage, encoded: Sequence[tuple[bytes, bytes, Any]], first: int, batch: int
) -> int:
    offset = first
    for start in range(0, len(encoded), batch):
        items = []
        for key, value, headers in encoded[start : start + batch]:
            items.append(Consumed(TOPIC, 0, offset, decode(key, value, headers)))
            offset += 1
        await stage.handle(items)
    return offset


def _wave(tag: str, rollouts: int, calls: int) -> tuple[list[Any], list[Any]]:
    """The encoded call events (admissions, staged) and the encoded seals of one wave."""
    opened: list[Record] = []
    seals: list[Record] = []
    for number in range(rollouts):
        *body, seal = rollout_events(f"{tag}{number}", calls)
        assert isinstance(seal, RolloutSeal)
        opened += body
        seals.append(seal)
    return _encoded(opened), _encoded(seals)


async def measure(rollouts: int, calls: int, *, batch: int = 500) -> dict[str, Any]:
    """Bytes per open rollout of ``calls`` calls, and bytes left after one and after two
    waves of ``rollouts`` finished rollouts (equal: finished rollouts leave nothing that grows)."""
    waves = [_wave(tag, rollouts, calls) for tag in ("a", "b")]
    stage = LedgerStage(_Discard())
    gc.collect()
    tracemalloc.start()
    held_open = 0
    left: list[int] = []
    try:
        base = tracemalloc.get_traced_memory()[0]
        offset = 0
        for opened, seals in waves:
            offset = await _feed(stage, opened, offset, batch)
            gc.collect()
            held_open = max(held_open, tracemalloc.get_traced_memory()[0] - base - (left[-1] if left else 0))
            offset = await _feed(stage, seals, offset, batch)
            stage.committable({(TOPIC, 0): offset})  # the consumer moved past every finished rollout
            gc.collect()
            left.append(tracemalloc.get_traced_memory()[0] - base)
    finally:
        tracemalloc.stop()
    assert stage.stats.receipts == 2 * rollouts and not stage.open
    return {
        "rollouts": rollouts,
        "calls_per_rollout": calls,
        "bytes_per_open_rollout": round(held_open / rollouts),
        "bytes_per_open_call": round(held_open / (rollouts * calls)),
        "bytes_left_after_wave": [round(b) for b in left],
        "growth_bytes_per_finished_rollout": round((left[1] - left[0]) / rollouts, 2),
    }


def run(rollouts: int = 1000, lengths: Sequence[int] = (4, 16, 64)) -> list[dict[str, Any]]:
    """``measure`` for each rollout length."""
    return [asyncio.run(measure(rollouts, calls)) for calls in lengths]


__all__ = ["measure", "run"]
