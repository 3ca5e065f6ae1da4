"""Every template family, every route, streaming and not: five-call episodes captured exactly.

Each family's tiny model (``make-tiny-model --template NAME``) is served by its own vLLM
CPU engine (``family_engine``). An episode is five greedy calls with two tool calls and
their results (``familykit``), spoken to the worker with ``ng_capture`` (the driver's
way) and to the gateway by an unmodified SDK agent; the sample must be exactly the
engine's prompts, ids and logprobs, and a Hugging Face forward's within 1e-4. A template
that drops earlier turns cannot be spliced: its continuation is rejected with
``prefix_splice_failed``, named by family, and nothing else is.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import openai
import pytest
from enginekit import (
    EngineCall,
    HFOracle,
    Rig,
    assert_matches_hf,
    assert_sample_is_what_the_engine_saw,
    start_rig,
)
from familykit import (
    CALLS,
    ROUTES,
    SYSTEM,
    TOOL_REQUEST,
    TOOL_RESULTS,
    FamilyEngine,
    FamilyReport,
    Reply,
    admitting,
    play,
    send,
    worker_clients,
)
from gatewaykit import agent_of, clean, sealed_session, serve_gateway

from pipeline.models.tiny import family
from topics.records import FinalizedEvent, StagedEvent, TrainingSample
from topics.wire import CAPTURE_FIELD

pytestmark = [pytest.mark.slow, pytest.mark.engine]

STREAMING = pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
# Keeps only the last two messages: its render of the history drops the turns the
# parent's exact tokens hold, so no boundary in it is the parent's.
WINDOWED = (
    "{%- for message in messages[-2:] -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' -}}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def check_exact(
    engine: FamilyEngine, oracle: HFOracle, rig: Rig, event: FinalizedEvent, sample: TrainingSample | None
) -> str:
    """The episode's sample is the engine's five calls and the HF forward's; the table's cell."""
    assert event.status == "accepted", event
    assert sample is not None and event.call_count == CALLS
    calls = rig.recorder.calls
    assert len(calls) == CALLS
    assert_sample_is_what_the_engine_saw(sample, [(call, 0) for call in calls])
    assert_matches_hf(oracle, engine.model_dir, sample)
    tokenizer = rig.worker.renderer.tokenizer
    text = tokenizer.decode(sample.token_ids)
    # Every turn reached the engine, the agent's tool requests and their results too.
    assert all(result in text for result in TOOL_RESULTS) and text.count(TOOL_REQUEST) == 2, text
    bos = family(engine.family).bos
    if bos is not None:
        assert sample.token_ids.count(tokenizer.convert_tokens_to_ids(bos)) == 1
    return "exact"


def worker_episode(
    engine: FamilyEngine, route: str, stream: bool, extra: dict[str, Any]
) -> tuple[Rig, FinalizedEvent, TrainingSample | None]:
    """Five calls spoken to the worker with ``ng_capture`` (and ``extra`` body fields)."""
    rig = start_rig(engine.host, engine.model_dir)
    rollout_id = f"r-{route}-{stream}"
    try:
        replies = play(route, stream, admitting(rig, rollout_id, **extra), **worker_clients(rig.url))
        assert [reply.coords().disposition for reply in replies] == ["staged"] * CALLS
        event, sample = rig.finalize(rollout_id)
    finally:
        rig.close()
    return rig, event, sample


def gateway_episode(
    engine: FamilyEngine, route: str, stream: bool, extra: dict[str, Any]
) -> tuple[Rig, FinalizedEvent, TrainingSample | None]:
    """Five calls from an unmodified SDK agent through the gateway (``extra`` in each body)."""

    def agent(opened: dict[str, Any]) -> None:
        messages = anthropic.Anthropic(
            base_url=opened["anthropic_base_url"], api_key=opened["api_key"], max_retries=0, timeout=120
        )
        replies = play(
            route, stream, lambda _: dict(extra), openai_client=agent_of(opened), anthropic_client=messages
        )
        for reply in replies:
            clean(reply.extra)

    rig = start_rig(engine.host, engine.model_dir)
    try:
        _, event, sample = sealed_session(rig, agent)
    finally:
        rig.close()
    return rig, event, sample


EPISODES = {"worker": worker_episode, "gateway": gateway_episode}


@STREAMING
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("where", list(EPISODES))
def test_episode_is_exact(
    family_engine: FamilyEngine,
    where: str,
    route: str,
    stream: bool,
    oracle: HFOracle,
    family_report: FamilyReport,
) -> None:
    family_report.attempt(family_engine.family, f"{where} {route}", stream)
    rig, event, sample = EPISODES[where](family_engine, route, stream, {})
    result = check_exact(family_engine, oracle, rig, event, sample)
    family_report.record(family_engine.family, f"{where} {route}", stream, result)


THINKING_OFF = "qwen3, thinking off"


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("where", list(EPISODES))
@pytest.mark.parametrize("family_engine", ["qwen3"], indirect=True)
def test_thinking_switched_off_is_captured_exactly(
    family_engine: FamilyEngine, where: str, route: str, oracle: HFOracle, family_report: FamilyReport
) -> None:
    """``chat_template_kwargs: {enable_thinking: false}`` on every call: each prompt ends
    with the pre-filled empty think block, and the sample is still exact."""
    family_report.attempt(THINKING_OFF, f"{where} {route}", False)
    extra = {"chat_template_kwargs": {"enable_thinking": False}}
    rig, event, sample = EPISODES[where](family_engine, route, False, extra)
    tokenizer = rig.worker.renderer.tokenizer
    empty_think = tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    for call in rig.recorder.calls:
        assert call.prompt_ids[-len(empty_think) :] == empty_think
    result = check_exact(family_engine, oracle, rig, event, sample)
    family_report.record(THINKING_OFF, f"{where} {route}", False, result)


@pytest.mark.parametrize("family_engine", ["chatml"], indirect=True)
def test_a_template_that_drops_turns_rejects_only_its_chain(
    family_engine: FamilyEngine, family_report: FamilyReport, caplog: pytest.LogCaptureFixture
) -> None:
    case = (
        "A worker serving `chatml` with a template that keeps only the last two messages (family `windowed`)"
    )
    family_report.note(case, "**failed**")
    rig = start_rig(
        family_engine.host, family_engine.model_dir, chat_template=WINDOWED, template_family="windowed"
    )
    client = openai.OpenAI(base_url=f"{rig.url}/v1", api_key="unused", max_retries=0, timeout=120)
    greedy: dict[str, Any] = {"model": "tiny", "temperature": 0.0, "max_tokens": 6}
    messages: list[Any] = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "2 + 3?"},
    ]
    try:
        kept = rig.admit("r-kept")
        client.chat.completions.create(
            messages=messages, extra_body={CAPTURE_FIELD: kept.model_dump(mode="json")}, **greedy
        )
        first = rig.admit("r-windowed")
        reply = client.chat.completions.create(
            messages=messages, extra_body={CAPTURE_FIELD: first.model_dump(mode="json")}, **greedy
        )
        parent = Reply("", reply.model_extra).coords()
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": "More?"},
        ]
        second = rig.admit("r-windowed", parent)
        with caplog.at_level(logging.WARNING, logger="stages.capture.vllm.scope"):
            served = client.chat.completions.create(
                messages=messages, extra_body={CAPTURE_FIELD: second.model_dump(mode="json")}, **greedy
            )
        failed = Reply("", served.model_extra).coords()
        assert served.choices[0].message.content is not None  # served all the same
        assert failed.disposition == "capture_failed" and failed.failure_reason == "prefix_splice_failed"
        metrics = httpx.get(f"{rig.url}/metrics", timeout=10).text
        rejected, _ = rig.finalize("r-windowed")
        accepted, sample = rig.finalize("r-kept")
    finally:
        rig.close()
    assert any(
        "prefix_splice_failed" in r.getMessage() and "template family windowed" in r.getMessage()
        for r in caplog.records
    ), caplog.text
    (splice,) = [
        line for line in metrics.splitlines() if line.startswith("tokentrail_worker_splice_failures_total")
    ]
    assert 'family="windowed"' in splice and splice.endswith(" 1.0"), splice
    assert rejected.status == "rejected" and rejected.rejection_reason == "prefix_splice_failed", rejected
    assert accepted.status == "accepted" and sample is not None, accepted
    family_report.note(
        case,
        "its continuation is served and rejected `prefix_splice_failed`, the log and the metric "
        "naming `windowed`; another rollout on it is accepted",
    )


# ------------------------------------------------------------- the render history policy

RENDER_CALLS = 4


def thinking_turns(index: int) -> list[dict[str, Any]]:
    """What the agent adds after the reply to call ``index - 1``: on even calls a question
    answered by a reasoned tool call and the tool's result, on odd ones one more result
    of that tool (no question, and no assistant turn the gateway would merge with the
    reply). Qwen3-style templates keep reasoning until the next question, so a question
    starts a new segment under ``render``; DeepSeek-style ones drop it always."""
    if index % 2:
        return [{"role": "tool", "tool_call_id": f"call_{index - 1}", "content": TOOL_RESULTS[1]}]
    call = {
        "id": f"call_{index}",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
    }
    return [
        {"role": "user", "content": f"What is {index} + 3?"},
        {"role": "assistant", "content": "<think>\nI should add.\n</think>\n\n", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{index}", "content": TOOL_RESULTS[0]},
    ]


@dataclass
class RenderEpisode:
    rig: Rig
    event: FinalizedEvent
    samples: list[TrainingSample]
    parents: list[str | None]
    """Each call's parent as the worker staged it, in call order."""
    call_ids: list[str]


def render_episode(engine: FamilyEngine, where: str) -> RenderEpisode:
    """Four calls of a rollout under ``history: render``, spoken to the worker (as a driver)
    or through the gateway (an SDK agent), sealed under ``chains``."""
    rig = start_rig(engine.host, engine.model_dir)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    previous: Reply | None = None
    try:
        with contextlib.ExitStack() as stack:
            if where == "worker":
                rollout_id = "r-render"
                client = openai.OpenAI(base_url=f"{rig.url}/v1", api_key="unused", max_retries=0, timeout=120)
            else:
                served = stack.enter_context(contextlib.contextmanager(serve_gateway)(rig))
                opened = served.session(history="render")
                rollout_id, client = opened["rollout_id"], agent_of(opened)
            for index in range(RENDER_CALLS):
                extra: dict[str, Any] = {}
                if where == "worker":
                    parent = None if previous is None else previous.coords()
                    admission = rig.admit(rollout_id, parent, history="render")
                    extra = {CAPTURE_FIELD: admission.model_dump(mode="json")}
                messages += thinking_turns(index)
                previous = send("chat", False, messages, extra, openai_client=client)
                messages.append({"role": "assistant", "content": previous.text})
            if where == "gateway":  # the gateway seals a render session under chains
                assert served.seal(rollout_id, {"reward": 1.0}).status_code == 200
                event, _ = rig.finalize(rollout_id, sealed=True)
            else:
                event, _ = rig.finalize(rollout_id, reward=1.0, sample_policy="chains")
        staged = [e for e in rig.worker_sink.payloads(StagedEvent) if isinstance(e, StagedEvent)]
        samples = [rig.data_plane.samples[key] for key in event.sample_keys]
    finally:
        rig.close()
    return RenderEpisode(
        rig,
        event,
        samples,
        [e.coords.parent_call_id for e in staged],
        [e.coords.call_id for e in staged],
    )


def segments_of(calls: list[EngineCall]) -> list[list[int]]:
    """Call indices grouped into segments: a call continues the last one exactly when its
    prompt starts with that call's prompt and generation."""
    segments: list[list[int]] = []
    for index, call in enumerate(calls):
        if index:
            before = calls[index - 1]
            exact = before.prompt_ids + before.only.token_ids
            if call.prompt_ids[: len(exact)] == exact:
                segments[-1].append(index)
                continue
        segments.append([index])
    return segments


@pytest.mark.parametrize("where", list(EPISODES))
@pytest.mark.parametrize("family_engine", ["qwen3", "deepseek_r1"], indirect=True)
def test_render_history_gives_one_exact_sample_per_segment(
    family_engine: FamilyEngine, where: str, oracle: HFOracle, family_report: FamilyReport
) -> None:
    """Under ``history: render`` the engine sees the template's render of every call; a
    call whose render does not extend its parent's tokens is staged as a new root, and the
    rollout gives one exact sample per segment, each with the rollout's reward."""
    case = f"`{family_engine.family}` under `history: render` ({where})"
    family_report.note(case, "**failed**")
    episode = render_episode(family_engine, where)
    calls = episode.rig.recorder.calls
    assert len(calls) == RENDER_CALLS and len(episode.call_ids) == RENDER_CALLS
    segments = segments_of(calls)
    expected = [
        None if segment[0] == index else episode.call_ids[index - 1]
        for segment in segments
        for index in segment
    ]
    assert episode.parents == expected
    assert 2 in [segment[0] for segment in segments]  # the second question rewrote the history
    event = episode.event
    assert event.status == "accepted" and len(episode.samples) == len(segments), event
    for sample, segment in zip(episode.samples, segments, strict=True):
        assert_sample_is_what_the_engine_saw(sample, [(calls[index], 0) for index in segment])
        assert_matches_hf(oracle, family_engine.model_dir, sample)
        assert sample.reward == 1.0
    family_report.note(
        case,
        f"{RENDER_CALLS} calls, {len(segments)} segments ({', '.join(str(len(s)) for s in segments)} calls), "
        f"{len(segments)} exact samples",
    )


@pytest.mark.parametrize("family_engine", ["deepseek_r1"], indirect=True)
def test_reasoning_is_served_in_each_api_s_shape_and_captured_whole(
    family_engine: FamilyEngine, oracle: HFOracle
) -> None:
    """The worker serves a reasoning family with the parser that fits it (``auto``): the
    reasoning DeepSeek-R1's template opens comes back as ``reasoning`` in Chat (vLLM's name
    for the older ``reasoning_content``), streamed and not, as a reasoning item in Responses
    and a thinking block in Messages; the row still holds every generated token, reasoning
    included, exactly."""
    rig = start_rig(family_engine.host, family_engine.model_dir)
    question = [{"role": "user", "content": "What is 2 + 3?"}]
    common: dict[str, Any] = {"model": "tiny", "temperature": 0.0}
    chat = openai.OpenAI(base_url=f"{rig.url}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = anthropic.Anthropic(base_url=rig.url, api_key="unused", max_retries=0, timeout=120)

    def capture(rollout_id: str) -> dict[str, Any]:
        return {CAPTURE_FIELD: rig.admit(rollout_id).model_dump(mode="json")}

    try:
        reply = chat.chat.completions.create(
            messages=question, max_tokens=12, extra_body=capture("r-chat"), **common
        )
        shown = {"r-chat": (reply.choices[0].message.model_extra or {}).get("reasoning")}
        streamed = ""
        for chunk in chat.chat.completions.create(
            messages=question, max_tokens=12, stream=True, extra_body=capture("r-chat-stream"), **common
        ):
            for choice in chunk.choices:
                streamed += (choice.delta.model_extra or {}).get("reasoning") or ""
        shown["r-chat-stream"] = streamed
        response = chat.responses.create(
            input=question, max_output_tokens=12, store=False, extra_body=capture("r-resp"), **common
        )
        shown["r-resp"] = "".join(
            part.text for item in response.output if item.type == "reasoning" for part in item.content or ()
        )
        message = messages.messages.create(
            model="tiny",
            messages=question,
            max_tokens=12,
            extra_body={"temperature": 0.0, **capture("r-msg")},
        )  # type: ignore[call-overload]
        shown["r-msg"] = "".join(block.thinking for block in message.content if block.type == "thinking")
        for rollout_id, reasoning in shown.items():
            assert reasoning, f"{rollout_id}: no reasoning in the reply"
            event, sample = rig.finalize(rollout_id)
            assert event.status == "accepted" and sample is not None, event
            call = next(
                c for c in rig.recorder.calls if c.prompt_ids == sample.token_ids[: len(c.prompt_ids)]
            )
            assert_sample_is_what_the_engine_saw(sample, [(call, 0)])
            assert_matches_hf(oracle, family_engine.model_dir, sample)
            generated = rig.worker.renderer.tokenizer.decode(
                [t for t, m in zip(sample.token_ids, sample.token_mask, strict=True) if m == 1.0]
            )
            assert reasoning.strip() in generated  # the row holds what the reply shows as reasoning
    finally:
        rig.close()


REWRITES = {
    "dropped": lambda reasoning, content: {"role": "assistant", "content": content},
    "moved_to_content": lambda reasoning, content: {
        "role": "assistant",
        "content": f"<think>\n{reasoning}\n</think>\n\n{content}",
    },
    "opening_tag_replaced": lambda reasoning, content: {  # a framework that parses thinking tags
        "role": "assistant",
        "content": f"\n\n{reasoning}\n</think>\n\n{content}",
    },
}


@pytest.mark.parametrize("family_engine", ["deepseek_r1"], indirect=True)
def test_an_agent_that_rewrites_reasoning_keeps_one_chain(
    family_engine: FamilyEngine, oracle: HFOracle
) -> None:
    """An agent behind the gateway sends each reply back with its reasoning rewritten, a
    different way each turn (dropped, moved into ``<think>`` tags in the content, the
    opening tag replaced by a blank line): every call is the previous one's child, the
    rollout is accepted as one exact sample (the continuation holds the tokens the model
    generated, reasoning included: ``history: exact``), and each rewrite is counted."""
    rig = start_rig(family_engine.host, family_engine.model_dir)
    try:
        with contextlib.contextmanager(serve_gateway)(rig) as served:
            opened = served.session()
            agent = agent_of(opened)
            messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 3?"}]
            for rewrite in [*REWRITES.values(), None]:
                reply = agent.chat.completions.create(
                    model=served.worker_models()[0], messages=messages, max_tokens=10, temperature=0.0
                )
                if rewrite is None:
                    break
                message = reply.choices[0].message
                reasoning = (message.model_extra or {}).get("reasoning") or ""
                assert reasoning, "the reasoning parser put nothing in the reply's reasoning"
                messages += [
                    rewrite(reasoning, message.content or ""),
                    {"role": "user", "content": "And then?"},
                ]
            calls = served.calls(opened["rollout_id"])
            assert [c["parent_call_id"] for c in calls] == [None, *(c["call_id"] for c in calls[:-1])], calls
            metrics = httpx.get(f"{served.url}/metrics", timeout=10).text
            for kind in REWRITES:
                assert f'tokentrail_gateway_reasoning_rewrites_total{{kind="{kind}"}} 1.0' in metrics, kind
            assert served.seal(opened["rollout_id"], {"reward": 1.0}).status_code == 200
            event, sample = rig.finalize(opened["rollout_id"], sealed=True)
    finally:
        rig.close()
    assert event.status == "accepted" and sample is not None and event.call_count == len(REWRITES) + 1, event
    assert_sample_is_what_the_engine_saw(sample, [(call, 0) for call in rig.recorder.calls])
    assert_matches_hf(oracle, family_engine.model_dir, sample)


def left_out_chat(served: Any, opened: dict[str, Any]) -> None:
    agent, messages = agent_of(opened), [{"role": "user", "content": "What is 2 + 3?"}]
    for _ in range(3):
        reply = agent.chat.completions.create(
            model=served.worker_models()[0], messages=messages, max_tokens=10, temperature=0.0
        )
        assert not reply.choices[0].message.content, "the reply holds more than reasoning"
        messages.append({"role": "user", "content": "And then?"})


def left_out_responses(served: Any, opened: dict[str, Any]) -> None:
    agent, items = agent_of(opened), [{"role": "user", "content": "What is 2 + 3?"}]
    for _ in range(3):
        reply = agent.responses.create(
            model=served.worker_models()[0], input=items, max_output_tokens=10, temperature=0.0, store=False
        )
        assert not reply.output_text, "the reply holds more than reasoning"
        items.append({"role": "user", "content": "And then?"})


def left_out_messages(served: Any, opened: dict[str, Any]) -> None:
    agent = anthropic.Anthropic(
        base_url=opened["anthropic_base_url"], api_key=opened["api_key"], max_retries=0, timeout=120
    )
    messages: list[Any] = [{"role": "user", "content": "What is 2 + 3?"}]
    for _ in range(3):
        reply = agent.messages.create(
            model=served.worker_models()[0], messages=messages, max_tokens=10, extra_body={"temperature": 0.0}
        )
        assert all(block.type == "thinking" for block in reply.content), reply.content
        messages.append({"role": "user", "content": "And then?"})


@pytest.mark.parametrize("family_engine", ["deepseek_r1"], indirect=True)
@pytest.mark.parametrize(
    "agent", [left_out_chat, left_out_responses, left_out_messages], ids=lambda a: a.__name__
)
def test_a_reasoning_only_reply_left_out_keeps_one_chain(
    family_engine: FamilyEngine, oracle: HFOracle, agent: Callable[[Any, dict[str, Any]], None]
) -> None:
    """Each reply is reasoning alone (the tiny model never closes it in 10 tokens), and the
    agent sends it back as no turn at all, as pydantic-ai and openai-agents do: each call
    is still the previous one's child (counted as ``reply_left_out``), and the sample holds
    every reply's exact tokens: the gateway put an empty assistant turn back where each
    one was, and the worker spliced the reply's tokens in its place."""
    rig = start_rig(family_engine.host, family_engine.model_dir)
    try:
        with contextlib.contextmanager(serve_gateway)(rig) as served:
            opened = served.session()
            agent(served, opened)
            calls = served.calls(opened["rollout_id"])
            assert [c["parent_call_id"] for c in calls] == [None, *(c["call_id"] for c in calls[:-1])], calls
            metrics = httpx.get(f"{served.url}/metrics", timeout=10).text
            assert 'tokentrail_gateway_reasoning_rewrites_total{kind="reply_left_out"} 2.0' in metrics
            assert served.seal(opened["rollout_id"], {"reward": 1.0}).status_code == 200
            event, sample = rig.finalize(opened["rollout_id"], sealed=True)
    finally:
        rig.close()
    assert event.status == "accepted" and sample is not None and event.call_count == 3, event
    assert_sample_is_what_the_engine_saw(sample, [(call, 0) for call in rig.recorder.calls])
    assert_matches_hf(oracle, family_engine.model_dir, sample)
