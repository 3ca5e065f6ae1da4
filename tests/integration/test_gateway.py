"""Unmodified agents captured through the gateway, on the real vLLM worker.

The agents are the official SDKs pointed at a rollout session's base URL, with no
tokentrail code at all: the gateway finds each call's parent from the history the agent
sends, publishes admissions and the seal, and strips its fields from what the agent sees.
The real ledger and finalizer turn each session into a sample, checked exactly against
the engine's ids and logprobs and against a Hugging Face forward.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from enginekit import (
    EngineHost,
    HFOracle,
    assert_matches_hf,
    assert_sample_is_what_the_engine_saw,
    start_rig,
    token_keys,
)
from gatewaykit import ENVIRONMENT, Served, agent_of, clean, serve_gateway

from pipeline.gateway.pacing import Pacing
from pipeline.run.sdk_agent import SdkAgent
from stages.driver import Job
from stages.envs.arithmetic import make_tasks
from topics.records import RolloutSeal
from topics.wire import CAPTURE_FIELD

pytestmark = [pytest.mark.slow, pytest.mark.engine]


@pytest.fixture
def served(host: EngineHost, model_dir: Path) -> Iterator[Served]:
    rig = start_rig(host, model_dir)
    try:
        yield from serve_gateway(rig)
    finally:
        rig.close()


def test_openai_agent_episode_streaming_and_not(served: Served, oracle: HFOracle, model_dir: Path) -> None:
    opened = served.session(group_id="g1")
    rollout_id = opened["rollout_id"]
    agent = agent_of(opened)
    listed = agent.models.list()  # what an SDK or framework asks first; admits nothing
    assert [m.id for m in listed.data] == served.worker_models()
    assert all("root" not in (m.model_extra or {}) for m in listed.data)  # no path on the worker's disk
    assert served.calls(rollout_id) == []
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages: list[Any] = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    reply = agent.chat.completions.create(
        model="tiny", messages=messages, tools=tools, temperature=0, max_tokens=8
    )
    clean(reply.model_extra)
    assert token_keys(reply.model_dump()) == set()
    messages += [reply.choices[0].message, {"role": "user", "content": "And times 4?"}]  # as SDK users do
    text = ""
    for chunk in agent.chat.completions.create(
        model="tiny", messages=messages, tools=tools, temperature=0, max_tokens=8, stream=True
    ):
        clean(chunk.model_extra)
        for choice in chunk.choices:
            clean(choice.model_extra)
            text += choice.delta.content or ""
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Thanks."}]
    agent.chat.completions.create(model="tiny", messages=messages, tools=tools, temperature=0, max_tokens=8)
    calls = served.calls(rollout_id)
    assert [c["parent_call_id"] for c in calls] == [None, calls[0]["call_id"], calls[1]["call_id"]]
    unknown = served.seal(rollout_id, {"reward": 1.0, "call_rewards": {"c-nobody": 0.5}})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "call_rewards.c-nobody"
    turns = {calls[0]["call_id"]: 0.25, calls[2]["call_id"]: 0.75}  # process rewards for two turns
    sealed = served.seal(rollout_id, {"reward": 1.0, "call_rewards": turns})
    assert sealed.status_code == 200, sealed.text
    event, sample = served.rig.finalize(rollout_id, sealed=True)
    assert event.status == "accepted", event
    assert sample is not None and sample.reward == 1.0 and event.call_count == 3
    assert [span.reward for span in sample.spans] == [0.25, None, 0.75]
    assert_sample_is_what_the_engine_saw(sample, [(call, 0) for call in served.rig.recorder.calls])
    assert_matches_hf(oracle, model_dir, sample)


def test_anthropic_agent_episode_streaming_and_not(served: Served, oracle: HFOracle, model_dir: Path) -> None:
    opened = served.session()
    rollout_id = opened["rollout_id"]
    agent = anthropic.Anthropic(
        base_url=opened["anthropic_base_url"], api_key=opened["api_key"], max_retries=0, timeout=120
    )
    assert [m.id for m in agent.models.list().data] == served.worker_models()
    greedy = {"temperature": 0.0}
    messages: list[Any] = [{"role": "user", "content": "What is 2 + 3?"}]
    message = agent.messages.create(model="tiny", max_tokens=8, messages=messages, extra_body=greedy)
    clean(message.model_extra)
    messages += [
        {"role": "assistant", "content": [block.model_dump() for block in message.content]},
        {"role": "user", "content": "And times 4?"},
    ]
    with agent.messages.stream(model="tiny", max_tokens=8, messages=messages, extra_body=greedy) as stream:
        final = stream.get_final_message()
    clean(final.model_extra)
    messages += [
        {"role": "assistant", "content": [block.model_dump() for block in final.content]},
        {"role": "user", "content": "Thanks."},
    ]
    agent.messages.create(model="tiny", max_tokens=8, messages=messages, extra_body=greedy)
    assert served.seal(rollout_id, {"reward": 0.5}).status_code == 200
    with pytest.raises(anthropic.ConflictError):  # the key died with the seal, discovery too
        agent.models.list()
    calls = served.calls(rollout_id)
    assert [c["parent_call_id"] for c in calls] == [None, calls[0]["call_id"], calls[1]["call_id"]]
    event, sample = served.rig.finalize(rollout_id, sealed=True)
    assert event.status == "accepted", event
    assert sample is not None and event.call_count == 3
    assert_sample_is_what_the_engine_saw(sample, [(call, 0) for call in served.rig.recorder.calls])
    assert_matches_hf(oracle, model_dir, sample)


def test_retries_collapse_and_rewritten_histories_start_roots(served: Served) -> None:
    opened = served.session()
    rollout_id = opened["rollout_id"]
    agent = agent_of(opened)
    first = [{"role": "user", "content": "What is 2 + 3?"}]
    reply = agent.chat.completions.create(model="tiny", messages=first, temperature=0, max_tokens=6)  # type: ignore[arg-type]
    second = [*first, reply.choices[0].message, {"role": "user", "content": "Sure?"}]
    for _ in range(2):  # the same history twice: a retry
        agent.chat.completions.create(model="tiny", messages=second, temperature=0, max_tokens=6)  # type: ignore[arg-type]
    calls = served.calls(rollout_id)
    assert len(calls) == 3
    assert calls[1]["parent_call_id"] == calls[2]["parent_call_id"] == calls[0]["call_id"]
    assert calls[1]["logical_call_id"] == calls[2]["logical_call_id"] != calls[0]["logical_call_id"]
    assert served.seal(rollout_id, {"reward": 1.0}).status_code == 200
    event, sample = served.rig.finalize(rollout_id, sealed=True)
    assert event.status == "accepted" and sample is not None, event
    assert event.call_count == 2  # the attempts collapsed

    # A rewritten history (compacted to a summary) is a new root in the same session.
    opened = served.session()
    other = opened["rollout_id"]
    agent = agent_of(opened)
    reply = agent.chat.completions.create(model="tiny", messages=first, temperature=0, max_tokens=6)  # type: ignore[arg-type]
    compacted = [{"role": "user", "content": "Summary: we added 2 and 3. Continue."}]
    agent.chat.completions.create(model="tiny", messages=compacted, temperature=0, max_tokens=6)  # type: ignore[arg-type]
    assert [c["parent_call_id"] for c in served.calls(other)] == [None, None]


def test_an_agent_that_compacts_its_history_gives_one_sample_per_segment(
    served: Served, oracle: HFOracle, model_dir: Path
) -> None:
    opened = served.session(group_id="g2")
    rollout_id = opened["rollout_id"]
    agent = agent_of(opened)

    def ask(messages: list[Any]) -> Any:
        reply = agent.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=6)
        return [*messages, reply.choices[0].message]

    segment = ask([{"role": "user", "content": "What is 2 + 3?"}])
    ask([*segment, {"role": "user", "content": "And times 4?"}])
    # The agent's context is full: it replaces the history with a summary and goes on.
    segment = ask([{"role": "user", "content": "Summary: 2 + 3 = 5, times 4 = 20. Now add 1."}])
    ask([*segment, {"role": "user", "content": "Thanks."}])
    calls = served.calls(rollout_id)
    assert [c["parent_call_id"] for c in calls] == [None, calls[0]["call_id"], None, calls[2]["call_id"]]

    sealed = served.seal(rollout_id, {"reward": 0.5, "sample_policy": "chains"})
    assert sealed.status_code == 200 and sealed.json()["sample_policy"] == "chains", sealed.text
    event, _ = served.rig.finalize(rollout_id, sealed=True)
    assert event.status == "accepted" and event.sample_policy == "chains", event
    assert [s.leaf_call_id for s in event.samples] == [calls[1]["call_id"], calls[3]["call_id"]]
    assert [s.status for s in event.samples] == ["accepted", "accepted"]
    engine_calls = served.rig.recorder.calls
    for keys, segment_calls in zip(event.sample_keys, (engine_calls[:2], engine_calls[2:]), strict=True):
        sample = served.rig.data_plane.samples[keys]
        assert sample.reward == 0.5 and sample.group_id == "g2"
        assert_sample_is_what_the_engine_saw(sample, [(call, 0) for call in segment_calls])
        assert_matches_hf(oracle, model_dir, sample)


def test_a_rewritten_episode_under_the_default_policy_trains_on_its_last_chain(
    served: Served, oracle: HFOracle, model_dir: Path
) -> None:
    """An agent that edits a reply for real starts a new root; sealed with the gateway's
    default ``terminal`` policy the rollout is not lost as ``ambiguous_terminal``: the seal
    names the last call, its chain is the one sample, and the rewrite is counted."""
    opened = served.session(group_id="g4")
    rollout_id = opened["rollout_id"]
    agent = agent_of(opened)
    question = {"role": "user", "content": "What is 2 + 3?"}
    reply = agent.chat.completions.create(model="tiny", messages=[question], temperature=0, max_tokens=6)  # type: ignore[list-item]
    edited = {"role": "assistant", "content": f"{reply.choices[0].message.content} (edited by the agent)"}
    history = [question, edited, {"role": "user", "content": "And times 4?"}]
    second = agent.chat.completions.create(model="tiny", messages=history, temperature=0, max_tokens=6)  # type: ignore[arg-type]
    history += [second.choices[0].message, {"role": "user", "content": "Thanks."}]
    agent.chat.completions.create(model="tiny", messages=history, temperature=0, max_tokens=6)  # type: ignore[arg-type]
    calls = served.calls(rollout_id)
    assert [c["parent_call_id"] for c in calls] == [None, None, calls[1]["call_id"]]
    before = served.built.sessions.rewritten_episodes
    sealed = served.seal(rollout_id, {"reward": 1.0})
    assert sealed.status_code == 200 and sealed.json()["terminal_call_id"] == calls[2]["call_id"], sealed.text
    assert served.built.sessions.rewritten_episodes == before + 1
    event, sample = served.rig.finalize(rollout_id, sealed=True)
    assert event.status == "accepted" and event.sample_policy == "terminal" and sample is not None, event
    assert (
        event.call_count == 2 and sample.reward == 1.0
    )  # the last chain; the edited-away draft is no sample
    assert_sample_is_what_the_engine_saw(sample, [(call, 0) for call in served.rig.recorder.calls[1:]])
    assert_matches_hf(oracle, model_dir, sample)


def test_template_kwargs_pass_through_and_a_change_starts_a_new_root(
    served: Served, oracle: HFOracle, model_dir: Path
) -> None:
    """``chat_template_kwargs`` reach the worker under capture; calls that keep them form
    one chain, and the call that changes them starts a new root, counted."""
    opened = served.session(group_id="g3")
    rollout_id = opened["rollout_id"]
    agent = agent_of(opened)

    def ask(messages: list[Any], kwargs: dict[str, Any]) -> list[Any]:
        reply = agent.chat.completions.create(
            model="tiny",
            messages=messages,
            temperature=0,
            max_tokens=6,
            extra_body={"chat_template_kwargs": kwargs},
        )
        return [*messages, reply.choices[0].message]

    history = ask([{"role": "user", "content": "What is 2 + 3?"}], {"enable_thinking": False})
    history = ask([*history, {"role": "user", "content": "And times 4?"}], {"enable_thinking": False})
    before = served.built.forwarder.counters.template_changes
    history = ask([*history, {"role": "user", "content": "Think it over."}], {"enable_thinking": True})
    ask([*history, {"role": "user", "content": "Sure?"}], {"enable_thinking": True})
    calls = served.calls(rollout_id)
    assert [c["parent_call_id"] for c in calls] == [None, calls[0]["call_id"], None, calls[2]["call_id"]]
    assert served.built.forwarder.counters.template_changes == before + 1

    assert served.seal(rollout_id, {"reward": 1.0, "sample_policy": "chains"}).status_code == 200
    event, _ = served.rig.finalize(rollout_id, sealed=True)
    assert event.status == "accepted" and [s.status for s in event.samples] == ["accepted", "accepted"], event
    engine_calls = served.rig.recorder.calls
    for key, segment_calls in zip(event.sample_keys, (engine_calls[:2], engine_calls[2:]), strict=True):
        sample = served.rig.data_plane.samples[key]
        assert_sample_is_what_the_engine_saw(sample, [(call, 0) for call in segment_calls])
        assert_matches_hf(oracle, model_dir, sample)


def test_bad_input_is_refused_and_nothing_stays_open(served: Served) -> None:
    opened = served.session()
    rollout_id = opened["rollout_id"]
    chat = f"{served.url}/rollouts/{rollout_id}/v1/chat/completions"
    key = {"authorization": f"Bearer {opened['api_key']}"}
    assert served.seal("nobody", {"reward": 1}).status_code == 404
    named = httpx.post(f"{served.url}/rollouts", json={"rollout_id": "a b"}, headers=ENVIRONMENT)
    assert named.status_code == 400 and named.json()["error"]["param"] == "rollout_id", named.text
    bad = httpx.post(chat, json={"messages": "hello"}, headers=key)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages", bad.text
    own = httpx.post(
        chat, json={"messages": [{"role": "user", "content": "x"}], CAPTURE_FIELD: {}}, headers=key
    )
    assert own.status_code == 400 and own.json()["error"]["param"] == CAPTURE_FIELD
    unsure = served.seal(rollout_id, {"status": "failed"})
    assert unsure.status_code == 400 and unsure.json()["error"]["param"] == "reason", unsure.text
    assert served.seal(rollout_id, {"reward": 1.0}).status_code == 200
    again = served.seal(rollout_id, {"reward": 0.0})
    assert again.status_code == 409 and "reward 1.0" in again.json()["error"]["message"]
    late = httpx.post(
        chat, json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}, headers=key
    )
    assert late.status_code == 409, late.text
    seals = [e.payload for e in served.rig.driver_sink.events if isinstance(e.payload, RolloutSeal)]
    assert [s.rollout_id for s in seals] == [rollout_id]
    assert seals[0].sealed_by is not None and seals[0].sealed_by.startswith("environment:")


def test_an_idle_session_is_sealed_abandoned(host: EngineHost, model_dir: Path) -> None:
    rig = start_rig(host, model_dir)
    try:
        for gw in serve_gateway(rig, session_ttl_s=0.5, sweep_every_s=0.1):
            opened = gw.session()
            rollout_id = opened["rollout_id"]
            agent = agent_of(opened)
            agent.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
            )
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and gw.show(rollout_id)["sealed"] is None:
                time.sleep(0.1)
            shown = gw.show(rollout_id)
            assert shown["sealed"]["failure_reason"] == "abandoned", shown
            assert shown["sealed"]["sealed_by"] == "gateway:ttl", shown
            event, _ = rig.finalize(rollout_id, sealed=True)
            assert event.status == "rejected" and event.rejection_reason == "rollout_failed", event
    finally:
        rig.close()


async def play_and_close(agent: SdkAgent, job: Job) -> None:
    try:
        await agent.play(job)
    finally:
        await agent.aclose()


def test_a_paced_gateway_holds_new_rollouts_until_the_workers_version_advances(
    host: EngineHost, model_dir: Path
) -> None:
    """One version of lead, two rollouts a step: four rollouts open at version 0, the fifth
    is a 429 with Retry-After (nothing published), admitted agents still call, and an
    environment that waits as told opens its rollout once the trainer's refit sets the
    workers' version to 1."""
    rig = start_rig(host, model_dir)
    pacing = Pacing(max_staleness=1, rollouts_per_step=2, refresh_s=0.01)
    try:
        for gw in serve_gateway(rig, pacing=pacing):
            opened = [gw.session(group_id="g") for _ in range(4)]

            def open_one(url: str = gw.url) -> httpx.Response:
                return httpx.post(f"{url}/rollouts", json={}, timeout=10, headers=ENVIRONMENT)

            events = len(rig.driver_sink.events)
            held = open_one()
            assert held.status_code == 429, held.text
            assert held.headers["Retry-After"] == "1"
            assert held.json()["error"]["param"] == "max_staleness", held.json()
            assert len(rig.driver_sink.events) == events  # nothing admitted, nothing published
            reply = agent_of(opened[0]).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
            )
            assert reply.choices[0].message is not None  # pacing holds new rollouts only

            environment = SdkAgent(gw.url, "tiny", max_turns=1, max_tokens=4, seed=0, headers=ENVIRONMENT)
            task = make_tasks(1, seed=0)[0]
            job = Job(f"paced-{secrets.token_hex(4)}", task, "g-paced")
            waiting = threading.Thread(target=asyncio.run, args=(play_and_close(environment, job),))
            waiting.start()
            deadline = time.monotonic() + 30
            while environment.stats.paced == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert environment.stats.paced >= 1 and environment.stats.admitted == 0
            # The trainer's refit labels the workers' weights with its new version.
            set_version = httpx.post(f"{rig.url}/admin/weight_version", json={"version": 1}, timeout=30)
            assert set_version.status_code == 200, set_version.text
            waiting.join(60)
            assert not waiting.is_alive() and environment.stats.sealed == 1, environment.stats
            assert gw.show(job.rollout_id)["sealed"] is not None
            assert [open_one().status_code for _ in range(2)] == [200, 429]  # six by version 1
            metrics = httpx.get(f"{gw.url}/metrics", timeout=10).text
            paced = 2 + environment.stats.paced
            assert f"tokentrail_gateway_paced_total {paced}.0" in metrics, metrics
            assert "tokentrail_gateway_policy_version 1.0" in metrics, metrics
            for session in opened:
                assert gw.seal(session["rollout_id"], {"reward": 0.0}).status_code == 200
    finally:
        rig.close()


def test_a_failed_worker_is_benched_and_the_call_retried(host: EngineHost, model_dir: Path) -> None:
    rig = start_rig(host, model_dir)
    try:
        dead = "http://127.0.0.1:9"  # nothing listens there: connection refused
        for gw in serve_gateway(rig, workers=(dead, rig.url)):
            opened = gw.session()
            rollout_id = opened["rollout_id"]
            agent = agent_of(opened)
            reply = agent.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
            assert reply.choices[0].message is not None
            health = httpx.get(f"{gw.url}/health").json()
            assert {w["url"]: w["failures"] for w in health["workers"]} == {dead: 1, rig.url: 0}
            calls = gw.calls(rollout_id)
            assert len(calls) == 2 and calls[0]["logical_call_id"] == calls[1]["logical_call_id"]
            assert [c["worker"] for c in calls] == [None, rig.url]
            assert gw.seal(rollout_id, {"reward": 1.0}).status_code == 200
            event, sample = rig.finalize(rollout_id, sealed=True)
            assert event.status == "accepted" and sample is not None and event.call_count == 1, event
    finally:
        rig.close()


def test_responses_previous_response_id_continues_the_named_call(
    served: Served, oracle: HFOracle, model_dir: Path
) -> None:
    opened = served.session()
    rollout_id = opened["rollout_id"]
    agent = agent_of(opened)
    common: dict[str, Any] = {"model": "tiny", "temperature": 0.0, "max_output_tokens": 6, "store": False}
    first = agent.responses.create(input="What is 2 + 3?", **common)
    clean(first.model_extra)
    second = agent.responses.create(input="And times 4?", previous_response_id=first.id, **common)
    completed = None
    for event in agent.responses.create(
        input="Thanks.", previous_response_id=second.id, stream=True, **common
    ):
        if event.type == "response.completed":
            completed = event
    assert completed is not None
    clean(completed.response.model_extra)
    with pytest.raises(openai.BadRequestError) as caught:
        agent.responses.create(input="x", previous_response_id="resp_unknown", **common)
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "previous_response_id"
    assert served.seal(rollout_id, {"reward": 1.0}).status_code == 200
    calls = served.calls(rollout_id)
    assert [c["parent_call_id"] for c in calls] == [None, calls[0]["call_id"], calls[1]["call_id"]]
    event, sample = served.rig.finalize(rollout_id, sealed=True)
    assert event.status == "accepted" and sample is not None and event.call_count == 3, event
    assert_sample_is_what_the_engine_saw(sample, [(call, 0) for call in served.rig.recorder.calls])
    assert_matches_hf(oracle, model_dir, sample)
