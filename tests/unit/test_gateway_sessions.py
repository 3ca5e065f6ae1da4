"""The gateway's lineage rules and session lifecycle, without a worker."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pipeline.api.errors import InvalidRequest
from pipeline.api.protocols import CHAT, COMPLETIONS
from pipeline.api.protocols.turns import Turn
from pipeline.gateway.history import extended, history_of
from pipeline.gateway.lineage import GatewayCall, episode_end, logical_call_id, parse_logical_call_id, resolve
from pipeline.gateway.recovery import _recovered
from pipeline.gateway.sessions import ABANDONED, Session, SessionError, Sessions
from pipeline.gateway.upstream import NoWorker, Workers
from stages.client import RolloutClient
from stages.memory import RecordingSink
from topics.records import CallCoords, CommitCoords, RolloutSeal


def chat(*texts: str) -> dict[str, Any]:
    roles = ["user", "assistant"]
    return {"messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(texts)]}


def answered(call_id: str, body: dict[str, Any], reply: str, parent: str | None = None) -> GatewayCall:
    history = history_of(CHAT, body)
    call = GatewayCall(
        call_id, logical_call_id(history), parent, history.kind, history.length, history.digest
    )
    length, digest = extended(history, Turn(role="assistant", text=reply))
    call.answered(length, digest, None, "http://w")
    return call


def test_child_retry_and_root() -> None:
    first = answered("c1", chat("hi"), "hello")
    second = answered("c2", chat("hi", "hello", "more"), "sure", parent="c1")
    calls = [first, second]
    by_id = {c.call_id: c for c in calls}
    # The longest extended prefix wins: a continuation of c2 is its child, not c1's.
    assert (
        resolve(calls, history_of(CHAT, chat("hi", "hello", "more", "sure", "again")), by_id).parent is second
    )
    assert resolve(calls, history_of(CHAT, chat("hi", "hello", "other")), by_id).parent is first
    # The same history again: a retry, under the retried call's parent, same logical id.
    retry = resolve(calls, history_of(CHAT, chat("hi", "hello", "more")), by_id)
    assert retry.retry_of is second and retry.parent is first
    # A reply the agent rewrote is not the reply the gateway returned: a new root.
    assert resolve(calls, history_of(CHAT, chat("hi", "HELLO", "more")), by_id).parent is None
    assert resolve(calls, history_of(CHAT, chat("summary")), by_id) == resolve(
        [], history_of(CHAT, chat("x")), {}
    )


def test_a_call_with_other_template_kwargs_is_a_new_root() -> None:
    thinking_off = {"chat_template_kwargs": {"enable_thinking": False}}
    first = answered("c1", {**chat("hi"), **thinking_off}, "hello")
    by_id = {"c1": first}
    same = history_of(CHAT, {**chat("hi", "hello", "more"), **thinking_off})
    assert resolve([first], same, by_id).parent is first
    for other in ({}, {"chat_template_kwargs": {"enable_thinking": True}}):
        assert (
            resolve([first], history_of(CHAT, {**chat("hi", "hello", "more"), **other}), by_id).parent is None
        )


def test_unanswered_calls_are_never_parents() -> None:
    history = history_of(CHAT, chat("hi"))
    pending = GatewayCall("c1", logical_call_id(history), None, history.kind, history.length, history.digest)
    assert resolve([pending], history_of(CHAT, chat("hi", "hello", "more")), {"c1": pending}).parent is None


def test_sessions_seal_once_and_abandon_idle_ones() -> None:
    now = [0.0]
    sink = RecordingSink()
    sessions = Sessions(RolloutClient(sink), ttl_s=10, clock=lambda: now[0])

    async def go() -> None:
        opened = sessions.open("r1", "g")
        assert sessions.open("r1") is opened
        with pytest.raises(SessionError) as caught:
            sessions.open("r1", "other-group")
        assert caught.value.status == 409
        await sessions.seal("r1", reward=1.0)
        for action in (sessions.seal("r1", reward=0.0), sessions.seal("nobody", reward=0.0)):
            with pytest.raises(SessionError) as caught:
                await action
            assert caught.value.status in (404, 409)
        with pytest.raises(SessionError) as caught:
            sessions.get("r1")
        assert caught.value.status == 409 and (await sessions.describe("r1"))["sealed"] is not None
        busy, idle = sessions.open("r2"), sessions.open("r3")
        busy.in_flight = 1
        now[0] = 11.0
        assert await sessions.sweep() == ["r3"] and idle.seal is not None
        assert sessions.abandoned == 1 and sessions.open_count == 1

    asyncio.run(go())
    seals = [e.payload for e in sink.events if isinstance(e.payload, RolloutSeal)]
    assert [(s.rollout_id, s.status, s.failure_reason) for s in seals] == [
        ("r1", "completed", None),
        ("r3", "failed", ABANDONED),
    ]


def test_a_sealed_session_keeps_its_seal_and_calls_not_its_conversations() -> None:
    """A gateway keeps its latest sealed sessions (``remember_sealed``): each keeps what it
    still shows and refuses with, not the Responses conversations it would continue."""
    sessions = Sessions(RolloutClient(RecordingSink()), ttl_s=10, remember_sealed=2)
    session = sessions.open("r1")
    session.add(answered("c1", chat("hi"), "hello"))
    session.responses.remember({"input": "hi"}, {"id": "resp-1", "output": [{"type": "message"}]})
    asyncio.run(sessions.seal("r1", reward=1.0))
    with pytest.raises(InvalidRequest):
        session.responses.expand({"previous_response_id": "resp-1"})
    assert not session.by_id and [c["call_id"] for c in asyncio.run(sessions.describe("r1"))["calls"]] == [
        "c1"
    ]
    for rollout_id in ("r2", "r3"):  # past ``remember_sealed``: the oldest is forgotten
        sessions.open(rollout_id)
        asyncio.run(sessions.seal(rollout_id, reward=0.0))
    for rollout_id, status in (("r1", 404), ("r2", 409)):
        with pytest.raises(SessionError) as caught:
            sessions.get(rollout_id)
        assert caught.value.status == status


def test_a_seal_names_its_sample_policy_or_takes_the_gateways() -> None:
    sink = RecordingSink()
    sessions = Sessions(RolloutClient(sink), ttl_s=10, sample_policy="chains")

    async def go() -> None:
        sessions.open("r1")
        sessions.open("r2")
        await sessions.seal("r1", reward=1.0)
        await sessions.seal("r2", reward=1.0, sample_policy="leaves", all_or_nothing=True)

    asyncio.run(go())
    seals = [e.payload for e in sink.events if isinstance(e.payload, RolloutSeal)]
    assert [(s.sample_policy, s.all_or_nothing) for s in seals] == [("chains", None), ("leaves", True)]


def test_a_render_session_keeps_its_policy_and_seals_under_chains_by_default() -> None:
    sink = RecordingSink()
    sessions = Sessions(RolloutClient(sink), ttl_s=10)

    async def go() -> None:
        sessions.open("r1", history="render")
        sessions.open("r2", history="render")
        sessions.open("r3")
        await sessions.seal("r1", reward=1.0)
        await sessions.seal("r2", reward=1.0, sample_policy="leaves")
        await sessions.seal("r3", reward=1.0)

    assert sessions.open("r0", history="render").history == "render"
    assert sessions.open("r0", history="render").describe()["history"] == "render"
    with pytest.raises(SessionError) as refused:
        sessions.open("r0")  # a rollout's history policy cannot change once it is open
    assert refused.value.status == 409 and "history render" in refused.value.message
    asyncio.run(go())
    seals = [e.payload for e in sink.events if isinstance(e.payload, RolloutSeal)]
    assert [s.sample_policy for s in seals] == ["chains", "leaves", "terminal"]


def test_workers_prefer_the_sessions_worker_then_the_least_loaded() -> None:
    now = [0.0]
    workers = Workers(["http://a", "http://b/"], cooldown_s=5, clock=lambda: now[0])
    assert workers.choose("http://b") == "http://b"

    async def serving_a() -> None:
        async with workers.serving("http://a", "r1"):
            assert workers.choose() == "http://b"

    asyncio.run(serving_a())
    workers.failed("http://b")
    assert workers.choose("http://b") == "http://a"
    with pytest.raises(NoWorker):
        workers.choose(avoid=["http://a"])
    now[0] = 6.0
    assert workers.healthy("http://b")


def test_logical_ids_carry_the_request_and_recovered_calls_continue_by_role() -> None:
    body = chat("hi")
    history = history_of(CHAT, body)
    logical = logical_call_id(history)
    assert parse_logical_call_id(logical) == ("turns", 1, history.digest)
    assert parse_logical_call_id(f"{logical}.3") == ("turns", 1, history.digest)  # a choice's
    assert parse_logical_call_id("c7-run-1") is None  # not the gateway's: not recovered
    text = history_of(COMPLETIONS, {"prompt": "2 + 3 ="})
    assert parse_logical_call_id(logical_call_id(text)) == ("text", 7, text.digest)
    recovered = GatewayCall("c1", logical, None, "turns", 1, history.digest, recovered=True)
    recovered.coords = object()  # type: ignore[assignment]  # any coords: it was staged
    calls, by_id = [recovered], {"c1": recovered}
    # Its reply is unknown: any assistant turn after its request continues it.
    assert resolve(calls, history_of(CHAT, chat("hi", "whatever it said", "more")), by_id).parent is recovered
    assert (
        resolve(calls, history_of(CHAT, {"messages": [{"role": "user", "content": "hi"}] * 2}), by_id).parent
        is None
    )


def test_a_recovered_segment_root_continues_from_its_own_key_alone() -> None:
    """After a restart, a call the worker staged as a new segment's root (``history:
    render``) anchors its children with a chain of its own key, as its reply's coords did."""
    client = RolloutClient(RecordingSink())
    root = client.admit("r1", call_id="c1", logical_call_id=logical_call_id(history_of(CHAT, chat("hi"))))
    parent = CommitCoords.model_validate({**_coords("r1", "c1", None, 0), "staging_chain": ["r1/c1"]})
    admitted = client.admit(
        "r1", parent, call_id="c2", history="render", logical_call_id=root.logical_call_id
    )
    as_child = CallCoords.model_validate(_coords("r1", "c2", "c1", parent.cum_len))
    as_root = CallCoords.model_validate(_coords("r1", "c2", None, 0))
    child = _recovered(admitted, as_child)
    segment = _recovered(admitted, as_root)
    assert child.coords is not None and child.coords.staging_chain == ["r1/c1", "r1/c2"]
    assert segment.coords is not None and segment.coords.staging_chain == ["r1/c2"]


def _coords(rollout_id: str, call_id: str, parent: str | None, prev_len: int) -> dict[str, object]:
    return {
        "rollout_id": rollout_id,
        "call_id": call_id,
        "parent_call_id": parent,
        "mode": "token_in" if parent else "text",
        "prev_len": prev_len,
        "delta_len": 5,
        "cum_len": prev_len + 5,
        "weight_version": 0,
        "staging_key": f"{rollout_id}/{call_id}",
        "chain_hash": "a" * 64,
        "cumulative_hash": "b" * 64,
        "digest": "c" * 64,
        "extras_digest": "d" * 64,
        "disposition": "staged",
    }


def _call(call_id: str, logical: str, parent: str | None) -> GatewayCall:
    return GatewayCall(call_id, logical, parent, "turns", 1, b"\0" * 16)


def test_the_episode_end_is_declared_only_when_the_calls_are_not_one_chain() -> None:
    """One chain: the ledger's unique leaf decides (None). Several roots, or one root with
    several leaves: the last call. Ending in one of ``n`` choices: truly ambiguous (None)."""
    chain = [_call("c1", "ht1-a", None), _call("c2", "ht3-b", "c1")]
    assert episode_end(chain) is None
    retried_root = [_call("c1", "ht1-a", None), _call("c1b", "ht1-a", None)]
    assert episode_end(retried_root) is None  # a retry of the root is no second root
    retried_then_extended = [*retried_root, _call("c2", "ht3-b", "c1b")]
    assert episode_end(retried_then_extended) is None  # nor is the unextended attempt a leaf
    rewritten = [*chain, _call("c3", "ht3-c", None), _call("c4", "ht5-d", "c3")]
    assert episode_end(rewritten) == "c4"
    choices = [*rewritten, _call("c5.0", "ht7-e.0", "c4"), _call("c5.1", "ht7-e.1", "c4")]
    assert episode_end(choices) is None
    # A reply sent back changed: the third call continues the first, beside the second.
    reply_rewritten = [*chain, _call("c3", "ht3-c", "c1")]
    assert episode_end(reply_rewritten) == "c3"
    one_choice_continued = [
        _call("c1", "ht1-a", None),
        _call("c2.0", "ht3-b.0", "c1"),
        _call("c2.1", "ht3-b.1", "c1"),
        _call("c3", "ht5-c", "c2.0"),
    ]
    assert episode_end(one_choice_continued) == "c3"
    assert episode_end(one_choice_continued[:3]) is None


def test_an_opening_travels_in_the_key_and_back() -> None:
    from pipeline.gateway.opening import opening_of, terms_of

    assert terms_of(None, "exact") == "" and opening_of("") == (None, "exact")
    for opening in (("g", "exact"), (None, "render"), ("g", "render")):
        assert opening_of(terms_of(*opening)) == opening
    with pytest.raises(ValueError, match="terms"):
        opening_of('{"group_id": 3, "history": "exact"}')


def test_a_replica_lets_go_of_an_idle_session_another_went_on_with() -> None:
    now = [0.0]
    sessions = Sessions(RolloutClient(RecordingSink()), ttl_s=10.0, clock=lambda: now[0])

    async def go() -> None:
        sessions.open("mine"), sessions.open("moved")

        async def still_ours(session: Session) -> bool:
            return session.rollout_id == "mine"

        sessions.still_ours = still_ours
        now[0] = 11.0
        assert await sessions.sweep() == ["mine"]
        assert sessions.abandoned == 1 and sessions.handed_over == 1 and sessions.open_count == 0

    asyncio.run(go())


def test_a_takeover_that_cannot_read_the_log_is_a_503() -> None:
    sessions = Sessions(RolloutClient(RecordingSink()), ttl_s=10.0)

    async def unreachable(rollout_id: str) -> None:
        raise ConnectionError("broker down")

    async def go() -> None:
        sessions.take_over = unreachable
        with pytest.raises(SessionError) as caught:
            await sessions.held("r1")
        assert caught.value.status == 503 and "r1" in caught.value.message

    asyncio.run(go())
