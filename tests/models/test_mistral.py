"""Mistral models as vLLM serves them by default: Tekken, conversations encoded by mistral_common.

The tiny model (``make-tiny-model --vocab mistral_tekken``) carries the Tekken file
mistral_common ships and no Hugging Face tokenizer. First the file as vLLM's mistral
tokenizer loads it is proved to encode as mistral_common's own ``Tekkenizer`` does, and a
Hugging Face forward (which needs only ids) to be usable as the oracle.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from enginekit import (
    EngineHost,
    HFOracle,
    Rig,
    assert_matches_hf,
    assert_sample_is_what_the_engine_saw,
    start_rig,
)
from familykit import (
    ADD_SCHEMA,
    ROUTES,
    TOOL_REQUEST,
    TOOL_RESULTS,
    Extra,
    Message,
    Reply,
    admitting,
    send,
    worker_clients,
)
from gatewaykit import agent_of, sealed_session
from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
from modelkit import ModelReport, played_cells
from vocabkit import diverse_strings

from pipeline.models.tekken import TEKKEN_FILE, TEKKEN_VOCAB, tekken_source, tekkenizer
from pipeline.models.tiny import make_tiny_model, read_manifest

USER = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 2 + 3?"}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD_SCHEMA}}]
"""The tool ``familykit`` sends on every call, in Chat Completions' shape."""


@pytest.fixture(scope="module")
def tekken_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seed-0 tiny Llama on Mistral NeMo's Tekken."""
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tekken", vocab=TEKKEN_VOCAB)


def test_the_model_directory_holds_tekken_and_records_it(tekken_dir: Path) -> None:
    import json

    manifest = read_manifest(tekken_dir)
    assert manifest is not None and manifest["spec"]["vocab"] == TEKKEN_VOCAB
    assert (tekken_dir / TEKKEN_FILE).read_bytes() == tekken_source().read_bytes()
    assert (
        not (tekken_dir / "tokenizer.json").exists() and not (tekken_dir / "tokenizer_config.json").exists()
    )
    reference = tekkenizer()
    config = json.loads((tekken_dir / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (reference.bos_id, reference.eos_id)
    assert config["vocab_size"] == reference.n_words == manifest["model_vocab_size"]
    generation = json.loads((tekken_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == manifest["eos_token_ids"] == [reference.eos_id]
    (tekken_dir / TEKKEN_FILE).rename(tekken_dir / "moved.json")
    try:
        assert read_manifest(tekken_dir) is None  # without its tokenizer the model is incomplete
    finally:
        (tekken_dir / "moved.json").rename(tekken_dir / TEKKEN_FILE)


def test_vllm_s_mistral_tokenizer_encodes_the_file_as_mistral_common_does(tekken_dir: Path) -> None:
    """What the engine serves through (vLLM's ``MistralTokenizer`` on the copied file) against
    mistral_common's ``Tekkenizer`` on the file the package ships, on 3,000 diverse strings."""
    from vllm.tokenizers.mistral import MistralTokenizer

    served = MistralTokenizer.from_pretrained(str(tekken_dir))
    reference = tekkenizer()
    strings = diverse_strings()
    differing = [
        text
        for text in strings
        if served.encode(text, add_special_tokens=False) != reference.encode(text, bos=False, eos=False)
    ]
    assert not differing, f"{len(differing)} of {len(strings)} differ; first: {differing[0]!r}"
    assert (served.bos_token_id, served.eos_token_id) == (reference.bos_id, reference.eos_id)
    assert served.encode("Hi", add_special_tokens=True)[0] == reference.bos_id


def test_transformers_alone_would_lose_bos_eos_and_the_chat_format(tekken_dir: Path) -> None:
    """Why the worker serves such a directory through mistral_common: the tokenizer
    transformers converts from the Tekken file has no BOS, no EOS and no chat template."""
    from transformers import AutoTokenizer

    converted = AutoTokenizer.from_pretrained(str(tekken_dir))
    assert converted.bos_token_id is None and converted.eos_token_id is None
    assert not getattr(converted, "chat_template", None)


def test_a_hugging_face_forward_is_the_oracle_on_ids_alone(tekken_dir: Path) -> None:
    """The oracle loads weights and config only: a forward over the ids mistral_common
    encodes gives a distribution over the whole Tekken vocabulary at every position."""
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from vllm.tokenizers.mistral import MistralTokenizer

    served = MistralTokenizer.from_pretrained(str(tekken_dir))
    ids = served.mistral.encode_chat_completion(ChatCompletionRequest.from_openai(USER)).tokens
    log_probs = HFOracle().log_softmax(tekken_dir, ids)
    assert tuple(log_probs.shape) == (len(ids), tekkenizer().n_words)
    for row in log_probs:
        assert math.isclose(float(row.exp().sum()), 1.0, abs_tol=1e-4)


# --------------------------------------------------------- the splice's rule under mistral_common


@pytest.fixture(scope="module")
def served(tekken_dir: Path) -> Any:
    """vLLM's ``MistralTokenizer`` on the model: what its mistral mode renders requests with."""
    from vllm.tokenizers.mistral import MistralTokenizer

    return MistralTokenizer.from_pretrained(str(tekken_dir))


def test_the_splice_counts_closed_assistant_turns(served: Any, tekken_dir: Path) -> None:
    """Only assistant turns close, each on ``</s>`` (a ``[TOOL_CALLS]`` one too), and the system
    text and tools move to the last user turn: the exact prefix goes back at the n-th ``</s>``
    of vLLM's render, n the turns it closes; a tool call the agent added in the model's name
    is passed over for the assistant turn the prefix ends with."""
    from stages.capture.splice import SpliceError
    from stages.capture.vllm.mistral import MistralChatRenderer

    renderer = MistralChatRenderer.of_engine(served, tekken_dir)
    eos = served.eos_token_id
    assert renderer.eos_token_ids == {eos} and renderer.template_text is None
    generated = served.encode(" five", add_special_tokens=False)
    first = served.apply_chat_template([dict(m) for m in USER], TOOLS, add_generation_prompt=True)
    cut = first + generated  # stopped at max_tokens: the splice adds the boundary </s>
    for history in (
        [{"role": "user", "content": "And 1 more?"}],
        next_turns(0, "five")[1:],  # the agent's tool call and its result
    ):
        messages = [*USER, {"role": "assistant", "content": "five"}, *history]
        full = served.apply_chat_template(messages, TOOLS, add_generation_prompt=True)
        tail = full[full.index(eos) + 1 :]
        assert renderer.spliced(cut, messages, TOOLS, full) == [*cut, eos, *tail]
        assert renderer.spliced([*cut, eos], messages, TOOLS, full) == [*cut, eos, *tail]
        assert full[: len(cut)] != cut  # the render moved the system text: no shortcut
    with pytest.raises(SpliceError, match="closes 1 turns but the exact prefix closes 2"):
        renderer.spliced([*first, eos, *generated], messages[:4], TOOLS, full)


# ----------------------------------------------------------------- served by vLLM's mistral mode

TOOL_CALL_ID = "a1b2c3d4e"
"""mistral_common's tool call ids are nine letters or digits."""
CALLS = 3


@pytest.fixture(scope="module")
def tekken_host(tekken_dir: Path) -> Iterator[EngineHost]:
    """A vLLM CPU engine serving the Tekken model through mistral_common."""
    from stages.capture.vllm.engine import EngineSettings

    host = EngineHost(EngineSettings(model=str(tekken_dir), tokenizer_mode="mistral"))
    try:
        yield host
    finally:
        host.close()


def next_turns(turn: int, reply: str) -> list[Message]:
    """After call 0 the agent asks for the add tool and calls it in the model's name (the
    random model never writes ``[TOOL_CALLS]`` itself), then adds the tool's result; after
    call 1 it asks again."""
    turns: list[Message] = [{"role": "assistant", "content": reply}]
    if turn == 0:
        call = {
            "id": TOOL_CALL_ID,
            "type": "function",
            "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
        }
        return [
            *turns,
            {"role": "user", "content": TOOL_REQUEST},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": TOOL_CALL_ID, "content": TOOL_RESULTS[0]},
        ]
    return [*turns, {"role": "user", "content": "And 1 more?"}]


def episode(route: str, stream: bool, extra: Extra, **clients: Any) -> list[list[Message]]:
    """The three calls; each call's conversation, as sent."""
    messages: list[Message] = [dict(m) for m in USER]
    sent: list[list[Message]] = []
    previous: Reply | None = None
    for turn in range(CALLS):
        sent.append([dict(m) for m in messages])
        previous = send(route, stream, messages, extra(previous), **clients)
        messages += next_turns(turn, previous.text)
    return sent


def mistral_common_ids(messages: list[Message]) -> list[int]:
    """mistral_common's own encoding of a request, from the file the package ships."""
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    tokenizer = MistralTokenizer.from_file(str(tekken_source()))
    request = ChatCompletionRequest.from_openai(messages, tools=TOOLS)
    return list(tokenizer.encode_chat_completion(request).tokens)


def check_exact(
    tekken_dir: Path, oracle: HFOracle, rig: Rig, sent: list[list[Message]], event: Any, sample: Any
) -> None:
    """One accepted chain, exact against the engine and the HF forward; every prompt's new
    turns are mistral_common's encoding, the first prompt wholly."""
    assert event.status == "accepted", event
    assert sample is not None and event.call_count == CALLS
    calls = rig.recorder.calls
    assert len(calls) == CALLS
    assert_sample_is_what_the_engine_saw(sample, [(call, 0) for call in calls])
    assert_matches_hf(oracle, tekken_dir, sample)
    reference = tekkenizer()
    assert calls[0].prompt_ids == mistral_common_ids(sent[0])
    # Later calls are not mistral_common's render: it moved the system text and the tools
    # to the new last user turn, and the earlier turns kept the tokens the model saw.
    assert all(
        call.prompt_ids != mistral_common_ids(messages)
        for call, messages in zip(calls[1:], sent[1:], strict=True)
    )
    for call, messages in zip(calls, sent, strict=True):
        expected = mistral_common_ids(messages)
        last_close = max((i for i, t in enumerate(expected) if t == reference.eos_id), default=0)
        tail = expected[last_close + 1 :] if last_close else expected
        assert call.prompt_ids[-len(tail) :] == tail  # system text and tools with the last user turn
    assert sample.token_ids.count(reference.bos_id) == 1
    text = reference.decode(sample.token_ids, special_token_policy=SpecialTokenPolicy.KEEP)
    assert TOOL_RESULTS[0] in text and "[TOOL_CALLS]" in text and text.count(TOOL_REQUEST) == 1, text


def worker_episode(
    host: EngineHost, tekken_dir: Path, route: str, stream: bool
) -> tuple[Rig, list[list[Message]], Any, Any]:
    """The three calls spoken to the worker with ``ng_capture``, as a driver does."""
    rig = start_rig(host, tekken_dir)
    rollout_id = f"r-{route}-{stream}"
    try:
        sent = episode(route, stream, admitting(rig, rollout_id), **worker_clients(rig.url))
        event, sample = rig.finalize(rollout_id)
    finally:
        rig.close()
    return rig, sent, event, sample


def gateway_episode(
    host: EngineHost, tekken_dir: Path, route: str, stream: bool
) -> tuple[Rig, list[list[Message]], Any, Any]:
    """The three calls from an unmodified SDK agent through the gateway."""

    def agent(opened: dict[str, Any]) -> list[list[Message]]:
        messages = anthropic.Anthropic(
            base_url=opened["anthropic_base_url"], api_key=opened["api_key"], max_retries=0, timeout=120
        )
        return episode(route, stream, lambda _: {}, openai_client=agent_of(opened), anthropic_client=messages)

    rig = start_rig(host, tekken_dir)
    try:
        sent, event, sample = sealed_session(rig, agent)
    finally:
        rig.close()
    return rig, sent, event, sample


EPISODES = {"worker": worker_episode, "gateway": gateway_episode}


@pytest.mark.slow
@pytest.mark.engine
# Through the gateway: the SDK agents' own clients, plain chat and a streamed protocol.
@played_cells(ROUTES, [("chat", False), ("messages", True)])
def test_three_calls_with_a_tool_call_are_one_exact_chain(
    tekken_host: EngineHost,
    tekken_dir: Path,
    oracle: HFOracle,
    where: str,
    route: str,
    stream: bool,
    model_report: ModelReport,
) -> None:
    cell = f"{'driver' if where == 'worker' else 'gateway'} exact"
    counted = route == "chat" and not stream  # the model table's cells are plain chat calls
    if counted:
        model_report.attempt(TEKKEN_VOCAB, cell)
    rig, sent, event, sample = EPISODES[where](tekken_host, tekken_dir, route, stream)
    check_exact(tekken_dir, oracle, rig, sent, event, sample)
    if counted:
        model_report.record(TEKKEN_VOCAB, cell, "accepted, exact")
