"""A worker's slots shared fairly: a flooding session cannot keep a polite one waiting."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import httpx
import pytest

from pipeline.gateway.calls import generated_tokens
from pipeline.gateway.capacity import LearnedCapacity
from pipeline.gateway.main import GatewayConfig, gateway
from pipeline.gateway.slots import FairSlots, fair_share
from pipeline.gateway.upstream import Workers
from stages.memory import RecordingSink


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


def test_at_defaults_a_flood_takes_no_slot_from_a_polite_session() -> None:
    """The default pool learns its capacity (starting at one slot): a flooder alone runs one
    call; a polite session arriving beside its queue of eight is granted at once, and the
    flooder never holds more than the polite session while both are active."""

    async def go() -> tuple[list[tuple[str, dict[str, int]]], Workers]:
        workers = Workers(["http://w"])  # no slots named: learned
        url = workers.urls[0]
        started: list[tuple[str, dict[str, int]]] = []
        release: dict[str, asyncio.Event] = {}
        running: Counter[str] = Counter()

        async def call(session: str, name: str) -> None:
            async with workers.serving(url, session) as use:
                running[session] += 1
                started.append((name, dict(running)))
                release[name] = asyncio.Event()
                await release[name].wait()
                running[session] -= 1
                use.generated(16)

        flood = [asyncio.create_task(call("flood", f"f{i}")) for i in range(8)]
        await asyncio.sleep(0.01)
        assert [name for name, _ in started] == ["f0"]
        polite = []
        for turn in range(3):
            polite.append(asyncio.create_task(call("polite", f"p{turn}")))
            await asyncio.sleep(0.01)
            assert started[-1][0] == f"p{turn}", started  # granted at once, ahead of f1..f7
            release[f"p{turn}"].set()
            await polite[-1]
            release[next(n for n in release if n.startswith("f") and not release[n].is_set())].set()
            await asyncio.sleep(0.01)
        for _ in range(20):
            for name in release:
                release[name].set()
            await asyncio.sleep(0.01)
        await asyncio.gather(*flood)
        return started, workers

    started, workers = asyncio.run(go())
    while_polite = [held for name, held in started if name.startswith("p")]
    assert all(held.get("flood", 0) <= held["polite"] for held in while_polite), while_polite
    assert workers.slot_waits() == [("http://w", 7)]  # the flooder's queue waited, no polite call


def test_a_session_s_first_call_never_waits_behind_a_learned_limit() -> None:
    """A learned limit of two, both held by a flooder: a polite session's call starts at
    once (three running), the flooder's third waits."""

    async def go() -> FairSlots:
        slots = FairSlots(LearnedCapacity(limit=2))
        gate = asyncio.Event()

        async def call(session: str) -> None:
            async with slots.hold(session):
                await gate.wait()

        flood = [asyncio.create_task(call("flood")) for _ in range(3)]
        await asyncio.sleep(0)
        assert slots.held == {"flood": 2}
        polite = asyncio.create_task(call("polite"))
        await asyncio.sleep(0)
        assert slots.held == {"flood": 2, "polite": 1} and slots.waited == 1
        gate.set()
        await asyncio.gather(*flood, polite)
        return slots

    assert asyncio.run(go()).busy == 0


def test_finished_sessions_are_forgotten_once_idle() -> None:
    """Sequential agents on a learned capacity (the default): each session's first call starts
    without a share being computed, and a finished session is forgotten after ``idle_s`` all
    the same, so a long-lived gateway keeps nothing per rollout it served."""

    async def go() -> FairSlots:
        clock = Clock()
        slots = FairSlots(LearnedCapacity(), idle_s=1.0, clock=clock)
        for number in range(1_000):
            async with slots.hold(f"rollout-{number}"):
                clock.now += 0.5
        return slots

    slots = asyncio.run(go())
    assert len(slots._released) <= 3 and not slots.held  # those released within the last idle_s


def test_worker_slots_zero_turns_fair_shares_off() -> None:
    workers = Workers(["http://w"], slots=0)
    assert workers.capacities() == [] and workers.slot_waits() == []
    with pytest.raises(ValueError, match="worker_slots"):
        Workers(["http://w"], slots=-1)


def test_the_gateway_is_fair_without_a_flag_and_shows_each_worker_s_slots() -> None:
    async def metrics(**config: Any) -> str:
        built_config = GatewayConfig(workers=("http://127.0.0.1:9",), **config)
        async with gateway(built_config, RecordingSink()) as built:
            transport = httpx.ASGITransport(app=built.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
                return (await http.get("/metrics")).text

    gauge = 'tokentrail_gateway_worker_slots{worker="http://127.0.0.1:9"}'
    assert f"{gauge} 1.0" in asyncio.run(metrics())  # learned, starting at one
    assert f"{gauge} 4.0" in asyncio.run(metrics(worker_slots=4))
    assert gauge not in asyncio.run(metrics(worker_slots=0))
    with pytest.raises(ValueError, match="worker_slots"):
        GatewayConfig(workers=("http://127.0.0.1:9",), worker_slots=-2)


@pytest.mark.parametrize(
    ("reply", "tokens"),
    [
        ({"usage": {"prompt_tokens": 9, "completion_tokens": 16}}, 16),  # OpenAI chat, completions
        ({"usage": {"input_tokens": 9, "output_tokens": 5}}, 5),  # Anthropic, Responses
        ({"usage": {"completion_tokens": True}}, None),
        ({"usage": "16"}, None),
        ({}, None),
    ],
)
def test_a_reply_s_generated_tokens_come_from_its_usage(reply: dict[str, Any], tokens: int | None) -> None:
    assert generated_tokens(reply) == tokens
