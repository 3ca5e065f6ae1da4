"""Every protocol an agent speaks, through the official SDKs, captured exactly.

The real vLLM worker (``enginekit``) on a real socket; the clients are the official
``openai`` and ``anthropic`` SDKs with no tokentrail code on their side except building
``ng_capture`` (sent with ``extra_body``). Each conversation is multi-turn with tools,
each turn admitted from the previous turn's commit coordinates, and finalized by the
real ledger and finalizer; every sample must be exactly the engine's ids and sampled
logprobs (``RecordingLLM``), and greedy ones the Hugging Face forward's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from enginekit import (
    EngineCall,
    EngineHost,
    HFOracle,
    Rig,
    assert_matches_hf,
    assert_sample_is_what_the_engine_saw,
    start_rig,
    token_keys,
)

from topics.choices import choice_admissions
from topics.records import CaptureAdmission, CommitCoords, StagedEvent
from topics.wire import CAPTURE_FIELD, COORDS_FIELD

pytestmark = [pytest.mark.slow, pytest.mark.engine]

GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 8}
ADD_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
    "required": ["a", "b"],
}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD_SCHEMA}}
]
ADD_CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}


@pytest.fixture
def rig(host: EngineHost, model_dir: Path) -> Iterator[Rig]:
    served = start_rig(host, model_dir)
    try:
        yield served
    finally:
        served.close()


def openai_client(rig: Rig) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{rig.url}/v1", api_key="unused", max_retries=0, timeout=120)


def anthropic_client(rig: Rig) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=rig.url, api_key="unused", max_retries=0, timeout=120)


def capture(admission: CaptureAdmission | list[CaptureAdmission]) -> dict[str, Any]:
    if isinstance(admission, list):
        return {CAPTURE_FIELD: [a.model_dump(mode="json") for a in admission]}
    return {CAPTURE_FIELD: admission.model_dump(mode="json")}


def coords_of(extra: dict[str, Any] | None) -> CommitCoords:
    assert extra is not None and COORDS_FIELD in extra, extra
    return CommitCoords.model_validate(extra[COORDS_FIELD])


def check_exact(
    rig: Rig, oracle: HFOracle, model_dir: Path, rollout_id: str, chain: list[tuple[EngineCall, int]]
) -> None:
    event, sample = rig.finalize(rollout_id)
    assert event.status == "accepted", event
    assert sample is not None and event.call_count == len(chain)
    assert_sample_is_what_the_engine_saw(sample, chain)
    assert_matches_hf(oracle, model_dir, sample)
    # Greedy on every route, and recorded as such (DESIGN §4.7).
    assert all(
        span.sampling is not None and span.sampling.extras() == {"temperature": 0.0} for span in sample.spans
    )


# --------------------------------------------------------------------------- chat


def test_chat_streaming_with_tools_captures_every_turn(rig: Rig, oracle: HFOracle, model_dir: Path) -> None:
    client = openai_client(rig)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 3? Use the add tool."}]
    parent: CommitCoords | None = None
    chain: list[tuple[EngineCall, int]] = []
    for turn in range(3):
        admission = rig.admit("r-chat-stream", parent)
        stream = client.chat.completions.create(
            model="tiny",
            messages=messages,
            tools=CHAT_TOOLS,
            stream=True,
            extra_body=capture(admission),
            **GREEDY,  # type: ignore[arg-type]
        )
        text, finals = "", []
        for chunk in stream:
            assert token_keys(chunk.model_dump()) == set()
            for choice in chunk.choices:
                text += choice.delta.content or ""
                if choice.finish_reason is not None:
                    finals.append(chunk)
        assert len(finals) == 1
        parent = coords_of(finals[0].model_extra)
        assert parent.disposition == "staged" and parent.call_id == admission.call_id
        assert finals[0].choices[0].model_extra is not None
        assert finals[0].choices[0].model_extra[COORDS_FIELD]["digest"] == parent.digest
        chain.append((rig.recorder.calls[-1], 0))
        if turn == 0:  # the agent ran a tool on the model's behalf: a tool call and its result
            messages += [
                {"role": "assistant", "content": None, "tool_calls": [ADD_CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"},
            ]
        else:
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Thanks."}]
    check_exact(rig, oracle, model_dir, "r-chat-stream", chain)


def test_chat_n4_gives_sibling_calls_and_a_grpo_group_from_one_request(rig: Rig) -> None:
    client = openai_client(rig)
    messages = [{"role": "user", "content": "Name a number."}]
    first = rig.admit("r-n")
    reply = client.chat.completions.create(
        model="tiny",
        messages=messages,
        extra_body=capture(first),
        **GREEDY,  # type: ignore[arg-type]
    )
    parent = coords_of(reply.model_extra)
    staged = [e.payload for e in rig.worker_sink.events if isinstance(e.payload, StagedEvent)]
    assert [event.response_id for event in staged] == [reply.id]  # the reply's own id
    # n=4 from one admission: choices are the siblings {call_id}.{i} of the same parent.
    admission = rig.client.admit("r-n", parent)
    rig.publish(choice_admissions(admission, 4))
    siblings = client.chat.completions.create(
        model="tiny",
        messages=[
            *messages,
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": "Another."},
        ],
        n=4,
        temperature=1.0,
        max_tokens=6,
        seed=7,
        extra_body=capture(admission),
    )
    assert reply.model_extra is not None and siblings.model_extra is not None
    assert COORDS_FIELD not in siblings.model_extra  # n > 1: per choice only
    coords = [coords_of(c.model_extra) for c in sorted(siblings.choices, key=lambda c: c.index)]
    assert [c.call_id for c in coords] == [f"{admission.call_id}.{i}" for i in range(4)]
    assert {c.parent_call_id for c in coords} == {first.call_id}
    assert all(c.disposition == "staged" and c.prev_len == parent.cum_len for c in coords)
    call = rig.recorder.calls[-1]
    assert sorted(call.choices) == [0, 1, 2, 3]
    event, sample = rig.finalize("r-n", terminal_call_id=coords[2].call_id)
    assert event.status == "accepted", event
    assert sample is not None
    assert_sample_is_what_the_engine_saw(sample, [(rig.recorder.calls[-2], 0), (call, 2)])

    # A list of n root admissions: each choice its own rollout of one group.
    roots = [rig.client.admit(f"g-{i}", group_id="g") for i in range(3)]
    rig.publish(roots)
    group = client.chat.completions.create(
        model="tiny", messages=messages, n=3, temperature=1.0, max_tokens=5, seed=3, extra_body=capture(roots)
    )
    call = rig.recorder.calls[-1]
    for choice in group.choices:
        got = coords_of(choice.model_extra)
        assert got.rollout_id == f"g-{choice.index}" and got.disposition == "staged"
        event, sample = rig.finalize(got.rollout_id, group_id="g")
        assert event.status == "accepted" and sample is not None, event
        assert_sample_is_what_the_engine_saw(sample, [(call, choice.index)])


def test_chat_options_are_honoured_or_refused(rig: Rig) -> None:
    client = openai_client(rig)
    messages = [{"role": "user", "content": "Say something."}]
    with_logprobs = client.chat.completions.create(
        model="tiny",
        messages=messages,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,  # type: ignore[arg-type]
    )
    content = with_logprobs.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == GREEDY["max_tokens"]
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    admission = rig.admit("r-opts")
    plain = client.chat.completions.create(
        model="tiny",
        messages=messages,
        extra_body=capture(admission),
        **GREEDY,  # type: ignore[arg-type]
    )
    assert plain.choices[0].logprobs is None  # captured logprobs are for the row, not the client
    assert token_keys(plain.model_dump()) == set()
    as_json = client.chat.completions.create(
        model="tiny",
        messages=messages,
        response_format={"type": "json_object"},
        temperature=0.0,
        max_tokens=40,
    )
    assert as_json.choices[0].message.content is not None
    for refused, param in [
        ({"store": True}, "store"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"kv_transfer_params": {"x": 1}}, "kv_transfer_params"),
        (
            {"use_beam_search": True, CAPTURE_FIELD: rig.client.admit("r-x").model_dump(mode="json")},
            "use_beam_search",
        ),
    ]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="tiny", messages=messages, extra_body=refused, **GREEDY)  # type: ignore[arg-type]
        body = caught.value.body
        assert isinstance(body, dict) and body.get("param") == param, body
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny",
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
            ],  # type: ignore[list-item]
            **GREEDY,  # type: ignore[arg-type]
        )
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "messages[0].content[0].type"


def test_a_client_that_disconnects_mid_stream_fails_its_call(rig: Rig) -> None:
    admission = rig.admit("r-gone")
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Count."}],
        "stream": True,
        "max_tokens": 2000,
        "ignore_eos": True,
        **capture(admission),
    }
    with (
        httpx.Client(base_url=rig.url, timeout=60) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        for _ in zip(range(3), response.iter_lines(), strict=False):
            pass
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        failed = [
            e.payload.coords
            for e in rig.worker_sink.events
            if isinstance(e.payload, StagedEvent) and e.payload.coords.call_id == admission.call_id
        ]
        if failed:
            break
        time.sleep(0.1)
    assert failed and failed[0].disposition == "capture_failed", failed
    assert failed[0].failure_reason == "client_disconnected"
    assert admission.staging_key not in rig.data_plane.calls


# --------------------------------------------------------------------------- Responses


def test_responses_streaming_and_not_with_function_tools(rig: Rig, oracle: HFOracle, model_dir: Path) -> None:
    client = openai_client(rig)
    tools = [{"type": "function", "name": "add", "description": "a + b", "parameters": ADD_SCHEMA}]
    common: dict[str, Any] = {
        "model": "tiny",
        "tools": tools,
        "temperature": 0.0,
        "max_output_tokens": 8,
        "store": False,
    }
    question = {"role": "user", "content": "What is 2 + 3? Use the add tool."}
    first = rig.admit("r-resp")
    response = client.responses.create(input=[question], extra_body=capture(first), **common)  # type: ignore[arg-type]
    parent = coords_of(response.model_extra)
    assert parent.disposition == "staged" and token_keys(response.model_dump()) == set()
    chain = [(rig.recorder.calls[-1], 0)]
    # The agent ran the tool: the function call and its output join the input.
    items: list[dict[str, Any]] = [
        question,
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"},
    ]
    second = rig.admit("r-resp", parent)
    completed = None
    for event in client.responses.create(input=items, stream=True, extra_body=capture(second), **common):  # type: ignore[arg-type]
        if event.type == "response.completed":
            completed = event
    assert completed is not None
    parent = coords_of(completed.response.model_extra)
    assert parent.disposition == "staged" and parent.parent_call_id == first.call_id
    chain.append((rig.recorder.calls[-1], 0))
    items += [
        {"role": "assistant", "content": completed.response.output_text},
        {"role": "user", "content": "Thanks."},
    ]
    third = rig.admit("r-resp", parent)
    response = client.responses.create(input=items, extra_body=capture(third), **common)  # type: ignore[arg-type]
    assert coords_of(response.model_extra).disposition == "staged"
    chain.append((rig.recorder.calls[-1], 0))
    check_exact(rig, oracle, model_dir, "r-resp", chain)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(input=[question], previous_response_id="resp_1", **common)  # type: ignore[arg-type]
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "previous_response_id"


# --------------------------------------------------------------------------- Messages


def test_anthropic_messages_streaming_and_not_with_tool_blocks(
    rig: Rig, oracle: HFOracle, model_dir: Path
) -> None:
    client = anthropic_client(rig)
    tools = [{"name": "add", "description": "a + b", "input_schema": ADD_SCHEMA}]
    # This SDK version has no typed temperature; the API's field is sent as it is.
    common: dict[str, Any] = {"model": "tiny", "tools": tools, "max_tokens": 8}
    greedy = {"temperature": 0.0}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 3? Use the add tool."}]
    first = rig.admit("r-msg")
    message = client.messages.create(messages=messages, extra_body={**greedy, **capture(first)}, **common)  # type: ignore[arg-type]
    parent = coords_of(message.model_extra)
    assert parent.disposition == "staged" and token_keys(message.model_dump()) == set()
    chain = [(rig.recorder.calls[-1], 0)]
    messages += [
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2, "b": 3}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"}]},
    ]
    second = rig.admit("r-msg", parent)
    text, delta = "", None
    for event in client.messages.create(
        messages=messages, stream=True, extra_body={**greedy, **capture(second)}, **common
    ):  # type: ignore[arg-type]
        if event.type == "content_block_delta" and event.delta.type == "text_delta":
            text += event.delta.text
        if event.type == "message_delta":
            delta = event
    assert delta is not None
    parent = coords_of(delta.model_extra)
    assert parent.disposition == "staged" and parent.parent_call_id == first.call_id
    chain.append((rig.recorder.calls[-1], 0))
    messages += [{"role": "assistant", "content": text or "ok"}, {"role": "user", "content": "Thanks."}]
    third = rig.admit("r-msg", parent)
    message = client.messages.create(messages=messages, extra_body={**greedy, **capture(third)}, **common)  # type: ignore[arg-type]
    assert coords_of(message.model_extra).disposition == "staged"
    chain.append((rig.recorder.calls[-1], 0))
    check_exact(rig, oracle, model_dir, "r-msg", chain)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}],
                }
            ],  # type: ignore[list-item, typeddict-item]
            **common,
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["type"] == "error"
    assert "messages[0].content[0].type" in error["error"]["message"]


# --------------------------------------------------------------------------- sampling provenance

TRUNCATED: dict[str, Any] = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}


def test_truncated_sampling_is_recorded_on_every_route(rig: Rig) -> None:
    """Temperature 0.7, top-p 0.8, top-k 20 through Completions, Responses and Messages,
    streaming and not, and as n=2 choices of one Chat call: every call records exactly those
    options, whichever way the client sent them (a typed field, or top-k as an extra)."""
    openai_, anthropic_ = openai_client(rig), anthropic_client(rig)
    top_k = {"top_k": TRUNCATED["top_k"]}
    openai_options = {"temperature": TRUNCATED["temperature"], "top_p": TRUNCATED["top_p"]}
    rollouts = []

    def admitted(route: str) -> dict[str, Any]:
        rollouts.append(f"r-prov-{route}")
        return capture(rig.admit(rollouts[-1]))

    for stream in (False, True):
        suffix = "stream" if stream else "once"
        completion = openai_.completions.create(
            model="tiny",
            prompt="2 + 3 =",
            max_tokens=6,
            stream=stream,
            seed=1,
            extra_body={**top_k, **admitted(f"cmpl-{suffix}")},
            **openai_options,
        )  # type: ignore[call-overload]
        if stream:  # a stream is captured once it is read to its end
            list(completion)
        response = openai_.responses.create(
            model="tiny",
            input="Say a number.",
            max_output_tokens=6,
            store=False,
            stream=stream,
            extra_body={**top_k, **admitted(f"resp-{suffix}")},
            **openai_options,
        )  # type: ignore[call-overload]
        if stream:  # a stream is captured once it is read to its end
            list(response)
        message = anthropic_.messages.create(  # this SDK has no typed sampling fields: sent as extras
            model="tiny",
            max_tokens=6,
            messages=[{"role": "user", "content": "Say a number."}],
            stream=stream,
            extra_body={**TRUNCATED, **admitted(f"msg-{suffix}")},
        )  # type: ignore[call-overload]
        if stream:  # a stream is captured once it is read to its end
            list(message)
    roots = [rig.client.admit(f"r-prov-n-{i}", group_id="g-prov") for i in range(2)]
    rig.publish(roots)
    openai_.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Name a number."}],
        n=2,
        max_tokens=5,
        seed=3,
        extra_body={**top_k, **capture(roots)},
        **openai_options,
    )  # type: ignore[call-overload]
    finalized = [rig.finalize(rollout) for rollout in rollouts]
    finalized += [rig.finalize(root.rollout_id, group_id="g-prov") for root in roots]
    for event, sample in finalized:
        assert event.status == "accepted" and sample is not None, event
        assert [span.sampling.extras() if span.sampling else None for span in sample.spans] == [TRUNCATED]
        assert not sample.unreplayable


def test_a_grammar_is_recorded_unreplayable_and_an_option_out_of_range_refused(rig: Rig) -> None:
    """A grammar's mask (``response_format``) cannot be replayed from the sample: the call
    is captured, its span names ``structured_outputs`` and the sample is flagged. An option
    out of range is vLLM's 400 naming it, and no row of the call is staged."""
    client = openai_client(rig)
    messages = [{"role": "user", "content": "Reply in JSON."}]
    client.chat.completions.create(
        model="tiny",
        messages=messages,
        response_format={"type": "json_object"},
        max_tokens=12,
        temperature=0.0,
        extra_body=capture(rig.admit("r-grammar")),
    )
    event, sample = rig.finalize("r-grammar")
    assert event.status == "accepted" and sample is not None, event
    assert [span.sampling.unreplayable if span.sampling else None for span in sample.spans] == [
        ["structured_outputs"]
    ]
    assert sample.unreplayable
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny", messages=messages, top_p=1.5, max_tokens=4, extra_body=capture(rig.admit("r-range"))
        )
    assert "top_p" in str(caught.value.body), caught.value.body
    # The admission was published, so the worker reports the call not served (the ledger
    # must not wait for it); no row of it is staged.
    events = [event.payload for event in rig.worker_sink.events if event.key == "r-range"]
    assert all(isinstance(e, StagedEvent) and e.coords.disposition != "staged" for e in events), events
    assert not [key for key in rig.data_plane.calls if key.startswith("r-range/")]


# --------------------------------------------------------------------------- Completions


def test_completions_with_token_and_text_prompts(rig: Rig, oracle: HFOracle, model_dir: Path) -> None:
    client = openai_client(rig)
    tokenizer = rig.worker.renderer.tokenizer
    first = rig.admit("r-cmpl")
    reply = client.completions.create(model="tiny", prompt="2 + 3 =", extra_body=capture(first), **GREEDY)  # type: ignore[arg-type]
    parent = coords_of(reply.model_extra)
    assert parent.disposition == "staged" and coords_of(reply.choices[0].model_extra).digest == parent.digest
    chain = [(rig.recorder.calls[-1], 0)]
    # Token ids: the exact prefix, then more.
    exact = chain[0][0].prompt_ids + chain[0][0].only.token_ids
    second = rig.admit("r-cmpl", parent)
    tail = tokenizer.encode(" and 4 * 5 =", add_special_tokens=False)
    streamed = client.completions.create(
        model="tiny",
        prompt=exact + tail,
        stream=True,
        extra_body=capture(second),
        **GREEDY,  # type: ignore[arg-type]
    )
    finals = [c for c in streamed if c.choices and c.choices[0].finish_reason is not None]
    parent = coords_of(finals[-1].model_extra)
    assert parent.disposition == "staged" and parent.prev_len == len(exact)
    chain.append((rig.recorder.calls[-1], 0))
    # Text that starts with the prefix's text: the exact ids for that part, tokenized rest.
    call = chain[-1][0]
    head = tokenizer.decode(call.prompt_ids + call.only.token_ids, skip_special_tokens=False)
    third = rig.admit("r-cmpl", parent)
    reply = client.completions.create(
        model="tiny", prompt=head + " done", extra_body=capture(third), **GREEDY
    )  # type: ignore[arg-type]
    assert coords_of(reply.model_extra).disposition == "staged"
    chain.append((rig.recorder.calls[-1], 0))
    check_exact(rig, oracle, model_dir, "r-cmpl", chain)
    # Two prompts cannot be one captured call.
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model="tiny", prompt=["a", "b"], extra_body=capture(rig.client.admit("r-two")), **GREEDY
        )  # type: ignore[arg-type]
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == CAPTURE_FIELD


def test_models_route_and_json_replies(rig: Rig) -> None:
    listed = openai_client(rig).models.list()
    assert [m.id for m in listed.data] == ["tiny"]
    health = httpx.get(f"{rig.url}/health", timeout=10).json()
    assert health["status"] == "ok" and json.dumps(health)
