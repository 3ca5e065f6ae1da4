"""gpt-oss (the harmony format) on a tiny model: its vocabulary, and its calls captured exactly.

The vocabulary is proven on plain text with the others (``test_vocabularies``); here its
special tokens are checked against harmony's own encoding, which is what vLLM renders
gpt-oss prompts and parses its replies with.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from enginekit import (
    LOGPROB_TOL,
    EngineCall,
    EngineHost,
    HFOracle,
    Rig,
    assert_sample_is_what_the_engine_saw,
    start_rig,
)
from familykit import as_responses
from gatewaykit import agent_of, clean, sealed_session
from modelkit import ModelReport, played_cells

from pipeline.models.tiny import make_tiny_model
from pipeline.models.vocabularies import load_tokenizer, vocabulary
from stages.capture.vllm.engine import EngineSettings
from stages.capture.vllm.logprobs import SAMPLED_ONLY
from topics.records import CommitCoords, FinalizedEvent, TrainingSample
from topics.wire import CAPTURE_FIELD, COORDS_FIELD


def test_harmonys_special_tokens_sit_at_harmonys_ids() -> None:
    """Every special token of the built vocabulary is harmony's token of that id, the control
    tokens the format is made of included; quicktok and tiktoken name 200018
    ``<|endofprompt|>`` where harmony keeps it reserved (neither format writes it)."""
    import openai_harmony

    harmony = openai_harmony.load_harmony_encoding(openai_harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    tokenizer = load_tokenizer(vocabulary("gpt_oss"))
    added = tokenizer.get_added_tokens_decoder()
    assert sorted(added) == list(range(199_998, 201_088))
    differing = {
        token_id: token.content
        for token_id, token in added.items()
        if harmony.encode(token.content, allowed_special="all") != [token_id]
    }
    assert differing == {200_018: "<|endofprompt|>"}
    assert all(token.special for token in added.values())
    control = {
        "<|return|>": 200_002,
        "<|constrain|>": 200_003,
        "<|channel|>": 200_005,
        "<|start|>": 200_006,
        "<|end|>": 200_007,
        "<|message|>": 200_008,
        "<|call|>": 200_012,
    }
    assert {name: tokenizer.token_to_id(name) for name in control} == control
    assert set(harmony.stop_tokens_for_assistant_actions()) == {200_002, 200_012}


# --------------------------------------------------------------------------- the engine

# A random model seldom writes harmony's structure, so each request steers it (greedy, so
# the same prompt gives the same reply). The tool call: a named tool whose strict schema
# allows one object; vLLM constrains the call to harmony's tool-call header and that
# schema, and the bias picks harmony's own <|message|> over its spelling in text, the JSON's
# characters over whitespace, and <|call|> to end it. The answers: a fixed final text
# (``structured_outputs`` choice, which vLLM puts on the final channel), <|end|> to close
# the reasoning the model writes first, <|return|> to end the reply, and no "<" (the
# grammar also takes harmony's tags spelled out in text, which harmony does not parse).
CALL, END, RETURN, MESSAGE = 200_012, 200_007, 200_002, 200_008
JSON_CHARACTERS = {token: 60 for token in (1, 11, 17, 18, 25, 90, 92)}  # " , 2 3 : { }
TOOL_BIAS = {MESSAGE: 60, CALL: 80, END: 70, **JSON_CHARACTERS}
LESS_THAN = 27  # "<": harmony's tags spelled out in text
ANSWER_BIAS = {RETURN: 60, END: 12, LESS_THAN: -100}
ADD_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "enum": [2]}, "b": {"type": "integer", "enum": [3]}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
SYSTEM = "You add numbers."
ANSWERS = ("The sum is 5.", "The sum is 9.")
TOOL_RESULT = "RESULT-FIVE"
MAX_TOKENS = 96
"""Room for an answer's reasoning, which the grammar leaves free: how long the random model
writes it hangs on near-ties in greedy decoding that the engine's arithmetic can tip, and at
48 a 21-token reasoning cut "The sum is 9." short."""
Message = dict[str, Any]


@dataclass(frozen=True)
class GptOssEngine:
    model_dir: Path
    host: EngineHost


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GptOssEngine]:
    """The tiny gpt-oss model (seed 0) served by one vLLM CPU engine."""
    model_dir = make_tiny_model(tmp_path_factory.mktemp("gpt-oss") / "model", vocab="gpt_oss")
    host = EngineHost(EngineSettings(model=str(model_dir)))
    try:
        yield GptOssEngine(model_dir, host)
    finally:
        host.close()


def steering(step: int) -> dict[str, Any]:
    """Call ``step``'s added body fields: the tool call first, then the two answers."""
    if step == 0:
        return {"logit_bias": {str(t): b for t, b in TOOL_BIAS.items()}}
    return {
        "logit_bias": {str(t): b for t, b in ANSWER_BIAS.items()},
        "structured_outputs": {"choice": [ANSWERS[step - 1]]},
    }


def tool_choice(route: str, step: int) -> Any:
    if step:
        return "none"
    return (
        {"type": "function", "name": "add"}
        if route == "responses"
        else {
            "type": "function",
            "function": {"name": "add"},
        }
    )


@dataclass
class Turn:
    """A reply as the agent keeps it (chat messages) and where its coords came."""

    messages: list[Message]
    extra: dict[str, Any] | None

    def coords(self) -> CommitCoords:
        assert self.extra is not None and COORDS_FIELD in self.extra, self.extra
        return CommitCoords.model_validate(self.extra[COORDS_FIELD])


def _chat(
    client: openai.OpenAI, stream: bool, messages: list[Message], step: int, extra: dict[str, Any]
) -> Turn:
    tools = [
        {
            "type": "function",
            "function": {"name": "add", "description": "a + b", "parameters": ADD_SCHEMA, "strict": True},
        }
    ]
    common: dict[str, Any] = {
        "model": "tiny",
        "messages": messages,
        "tools": tools,
        "tool_choice": tool_choice("chat", step),
        "temperature": 0.0,
        "max_tokens": MAX_TOKENS,
        "extra_body": {**steering(step), **extra},
    }
    if not stream:
        reply = client.chat.completions.create(**common)
        message = reply.choices[0].message
        calls = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for c in message.tool_calls or []
        ]
        reasoning = (message.model_extra or {}).get("reasoning")
        return Turn([_assistant(message.content, reasoning, calls)], reply.model_extra)
    content, reasoning, calls, final = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **common):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(
                    delta.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                )
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["function"]["name"] += delta.function.name or ""
                    call["function"]["arguments"] += delta.function.arguments or ""
            if choice.finish_reason is not None:
                final = chunk
    assert final is not None
    return Turn([_assistant(content, reasoning, list(calls.values()))], final.model_extra)


def _assistant(content: str | None, reasoning: str | None, calls: list[Message]) -> Message:
    message: Message = {"role": "assistant", "content": content or None}
    if reasoning:
        message["reasoning"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def _responses(
    client: openai.OpenAI, stream: bool, messages: list[Message], step: int, extra: dict[str, Any]
) -> Turn:
    tools = [
        {"type": "function", "name": "add", "description": "a + b", "parameters": ADD_SCHEMA, "strict": True}
    ]
    common: dict[str, Any] = {
        "model": "tiny",
        "input": as_responses(messages),
        "tools": tools,
        "tool_choice": tool_choice("responses", step),
        "temperature": 0.0,
        "max_output_tokens": MAX_TOKENS,
        "store": False,
        "extra_body": {**steering(step), **extra},
    }
    if stream:
        response = None
        for event in client.responses.create(stream=True, **common):
            if event.type == "response.completed":
                response = event.response
        assert response is not None
    else:
        response = client.responses.create(**common)
    calls = [
        {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
        for item in response.output
        if item.type == "function_call"
    ]
    reasoning = "".join(
        part.text for item in response.output if item.type == "reasoning" for part in item.content or []
    )
    return Turn([_assistant(response.output_text, reasoning, calls)], response.model_extra)


ROUTES = {"chat": _chat, "responses": _responses}


def play(
    route: str, stream: bool, client: openai.OpenAI, extra: Callable[[Turn | None], dict[str, Any]]
) -> list[Turn]:
    """Three calls: a tool call, the answer after its result, the answer to a second question."""
    messages: list[Message] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    turns: list[Turn] = []
    for step in range(3):
        turn = ROUTES[route](client, stream, messages, step, extra(turns[-1] if turns else None))
        turns.append(turn)
        messages += turn.messages
        if step == 0:
            (call,) = turn.messages[0]["tool_calls"]
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": TOOL_RESULT})
        elif step == 1:
            messages.append({"role": "user", "content": "And 4 more?"})
    return turns


def worker_episode(
    engine: GptOssEngine, route: str, stream: bool
) -> tuple[Rig, list[Turn], FinalizedEvent, TrainingSample | None]:
    """The driver's way: each call carries its admission, continuing the reply before it."""
    rig = start_rig(engine.host, engine.model_dir)
    rollout_id = f"r-{route}-{stream}"
    try:

        def admit(previous: Turn | None) -> dict[str, Any]:
            admission = rig.admit(rollout_id, None if previous is None else previous.coords())
            return {CAPTURE_FIELD: admission.model_dump(mode="json")}

        client = openai.OpenAI(base_url=f"{rig.url}/v1", api_key="unused", max_retries=0, timeout=300)
        turns = play(route, stream, client, admit)
        event, sample = rig.finalize(rollout_id)
    finally:
        rig.close()
    return rig, turns, event, sample


def gateway_episode(
    engine: GptOssEngine, route: str, stream: bool
) -> tuple[Rig, list[Turn], FinalizedEvent, TrainingSample | None]:
    """An unmodified SDK agent through the gateway: the parent of each call is found from its history."""

    def agent(opened: dict[str, Any]) -> list[Turn]:
        turns = play(route, stream, agent_of(opened), lambda _: {})
        for turn in turns:
            clean(turn.extra)
        return turns

    rig = start_rig(engine.host, engine.model_dir)
    try:
        turns, event, sample = sealed_session(rig, agent)
    finally:
        rig.close()
    return rig, turns, event, sample


EPISODES = {"worker": worker_episode, "gateway": gateway_episode}


@pytest.mark.slow
@pytest.mark.engine
# Through the gateway: the SDK agent's own client, plain chat and streamed Responses.
@played_cells(ROUTES, [("chat", False), ("responses", True)])
def test_a_harmony_episode_with_a_tool_call_is_one_exact_chain(
    gpt_oss: GptOssEngine, where: str, route: str, stream: bool, oracle: HFOracle, model_report: ModelReport
) -> None:
    cell = f"{'driver' if where == 'worker' else 'gateway'} exact"
    counted = route == "chat" and not stream  # the model table's cells are plain chat calls
    if counted:
        model_report.attempt("gpt_oss", cell)
    rig, turns, event, sample = EPISODES[where](gpt_oss, route, stream)
    assert [
        turn.messages[0].get("tool_calls", [{}])[0].get("function", {}).get("name") for turn in turns
    ] == [
        "add",
        None,
        None,
    ]
    # The answers as vLLM parsed them (the grammar lets the model close the final text
    # with <|end|> before <|return|>, which vLLM's parser then keeps in the content).
    assert turns[0].messages[0]["content"] is None
    assert all(
        turn.messages[0]["content"].startswith(answer)
        for turn, answer in zip(turns[1:], ANSWERS, strict=True)
    )
    assert event.status == "accepted", event
    assert sample is not None and event.call_count == 3
    calls = rig.recorder.calls
    assert len(calls) == 3
    assert_sample_is_what_the_engine_saw(sample, [(call, 0) for call in calls])
    generated = [call.only.token_ids for call in calls]
    # Every channel the model wrote is in the row: the tool call closed by <|call|>, each
    # answer's reasoning and its final text closed by <|return|>.
    tokenizer = rig.worker.renderer.tokenizer
    texts = [tokenizer.decode(ids, skip_special_tokens=False) for ids in generated]
    assert "to=functions.add" in texts[0] and generated[0][-1] == CALL, texts[0]
    for text, ids, answer in zip(texts[1:], generated[1:], ANSWERS, strict=True):
        assert "<|channel|>analysis<|message|>" in text and f"<|channel|>final<|message|>{answer}" in text
        assert ids[-1] == RETURN, text
    # The splice: each continuation holds its parent's tokens as generated, the stop id
    # included, where harmony's render of the history writes <|end|> after an answer.
    first_end = len(calls[0].prompt_ids) + len(generated[0])
    second_end = len(calls[1].prompt_ids) + len(generated[1])
    assert calls[1].prompt_ids[first_end - 1] == CALL
    assert calls[2].prompt_ids[second_end - 1] == RETURN
    assert_matches_hf_relatively(oracle, rig, gpt_oss.model_dir, sample)
    if counted:
        model_report.record("gpt_oss", cell, "accepted, exact (logprob differences: a grammar steered it)")


def assert_matches_hf_relatively(oracle: HFOracle, rig: Rig, model_dir: Path, sample: TrainingSample) -> None:
    """The sample against a Hugging Face forward of its ids, within 1e-4, where the request's
    grammar narrowed the engine's distribution.

    The engine's logprobs are of the distribution it sampled from: the request's bias
    added, and the tokens the grammar forbade removed (a removal the forward cannot know).
    Differences between two tokens' logprobs do not depend on what was removed, so each call
    is run again with the top 20 logprobs, and at every generated position each of them,
    less the sampled token's, must be the forward's difference (bias added); the sampled
    token must be the top one (greedy), and the sample's logprob the engine's.
    """
    log_probs = oracle.log_softmax(model_dir, sample.token_ids)
    for call in rig.recorder.calls:
        again = rig.host.run(_top_logprobs(rig.host.engine.llm, call))
        assert again.token_ids == call.only.token_ids
        bias = call.params.logit_bias or {}
        start = len(call.prompt_ids)
        for offset, (token, top) in enumerate(zip(again.token_ids, again.logprobs, strict=True)):
            position = start + offset
            expected = log_probs[position - 1]
            sampled = top[token].logprob
            assert sampled == max(entry.logprob for entry in top.values()), position
            assert abs(sampled - sample.logprobs[position]) <= 1e-6, position
            for other, entry in top.items():
                if not math.isfinite(entry.logprob):
                    continue
                forward = (
                    float(expected[other] - expected[token]) + bias.get(other, 0.0) - bias.get(token, 0.0)
                )
                assert abs((entry.logprob - sampled) - forward) <= LOGPROB_TOL, (position, other)


async def _top_logprobs(llm: Any, call: EngineCall) -> Any:
    from vllm.sampling_params import RequestOutputKind

    params = call.params.clone()
    params.logprobs = 20
    params.output_kind = RequestOutputKind.FINAL_ONLY
    params.extra_args = {k: v for k, v in (params.extra_args or {}).items() if k != SAMPLED_ONLY}
    final = None
    async for output in llm.generate(
        {"prompt_token_ids": call.prompt_ids}, params, f"again-{uuid.uuid4().hex}", **call.options
    ):
        final = output
    assert final is not None
    return final.outputs[0]
