"""A worker's slots shared fairly: a flooding session cannot keep a polite one waiting."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.gateway.slots import FairSlots, fair_share


def test_the_share_is_an_equal_split_of_at_least_one() -> None:
    assert fair_share(8, 1) == 8  # alone: all of them
    assert fair_share(8, 2) == 4
    assert fair_share(2, 5) == 1  # more sessions than slots: each still makes progress
    assert fair_share(4, 0) == 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_polite_session_gets_the_next_slot_before_a_flooder_s_queue() -> None:
    """Two slots, a flooder queueing eight calls: the polite session's call takes the first
    slot freed, ahead of the flooder's queue, and the flooder never holds both again while the
    polite session is active (between its calls, for ``idle_s``)."""

    async def go() -> list[tuple[str, dict[str, int]]]:
        clock = Clock()
        slots = FairSlots(2, idle_s=10.0, clock=clock)
        started: list[tuple[str, dict[str, int]]] = []
        release: dict[str, asyncio.Event] = {}

        async def call(session: str, name: str) -> None:
            async with slots.hold(session):
                started.append((name, dict(slots.held)))
                release[name] = asyncio.Event()
                await release[name].wait()

        flood = [asyncio.create_task(call("flood", f"f{i}")) for i in range(8)]
        await asyncio.sleep(0)
        assert slots.held == {"flood": 2} and slots.waited == 6  # alone, it may hold all
        polite = asyncio.create_task(call("polite", "p0"))
        await asyncio.sleep(0)
        release["f0"].set()
        await asyncio.sleep(0.01)
        assert started[-1] == ("p0", {"flood": 1, "polite": 1})  # the freed slot, ahead of f2..f7
        release["f1"].set()  # the flooder gets the freed slot back, but no more than its share
        await asyncio.sleep(0.01)
        assert slots.held == {"flood": 1, "polite": 1}, slots.held
        release["p0"].set()
        await polite
        second = asyncio.create_task(call("polite", "p1"))  # its next call, within idle_s
        await asyncio.sleep(0.01)
        assert started[-1][0] == "p1", started  # no wait behind the flooder's queue
        release["p1"].set()
        await second
        clock.now = 100.0  # the polite session went idle: the flooder may take both again
        for name in [n for n in release if n.startswith("f")]:
            release[name].set()
        for _ in range(20):
            await asyncio.sleep(0.01)
            for name in [n for n in release if n.startswith("f")]:
                release[name].set()
        await asyncio.gather(*flood)
        return started

    started = asyncio.run(go())
    assert sum(1 for name, held in started if held.get("flood", 0) == 2) >= 2


def test_a_cancelled_wait_gives_nothing_away() -> None:
    async def go() -> FairSlots:
        slots = FairSlots(1)
        gate = asyncio.Event()

        async def hold() -> None:
            async with slots.hold("a"):
                await gate.wait()

        first = asyncio.create_task(hold())
        await asyncio.sleep(0)
        waiting = asyncio.create_task(hold())
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        gate.set()
        await first
        return slots

    slots = asyncio.run(go())
    assert slots.busy == 0 and not slots.held


def test_a_worker_needs_a_slot() -> None:
    with pytest.raises(ValueError, match="worker_slots: must be >= 1"):
        FairSlots(0)
