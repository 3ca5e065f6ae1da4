"""The vLLM worker's capture edges on a real engine: re-rendered history, plain calls, refits.

One vLLM CPU engine serves the module (``enginekit``); each test serves its own worker
over real HTTP. The protocols themselves (Chat, Completions, Responses, Messages,
streaming, ``n``) are in ``test_protocols``.

Oracle: a Hugging Face fp32 forward of the same tiny model. The seed-0 tiny model with
the reasoning-stripping template has the same weights and tokenizer as the ChatML one
(only the template differs, and the worker is given it with ``chat_template``), so one
engine serves both.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from enginekit import (
    LOGPROB_TOL,
    EngineHost,
    HFOracle,
    Rig,
    assert_matches_hf,
    assert_sample_is_what_the_engine_saw,
    start_rig,
    token_keys,
)

from pipeline.models.tiny import make_tiny_model, reasoning_stripping_template
from topics.records import EXTRAS_WEIGHT_SPANS, CaptureAdmission, CommitCoords
from topics.wire import CAPTURE_FIELD, COORDS_FIELD

pytestmark = [pytest.mark.slow, pytest.mark.engine]

GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 12}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@dataclass(frozen=True)
class Models:
    chatml: Path
    refit: Path  # seed 1: same tokenizer, other weights


@pytest.fixture(scope="module")
def models(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Models:
    """The engine's model (``host`` serves ``model_dir``) and the same one with other weights."""
    return Models(chatml=model_dir, refit=make_tiny_model(tmp_path_factory.mktemp("refit") / "m", seed=1))


def chat(rig: Rig, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{rig.url}/v1/chat/completions", json=body, timeout=120)


def captured_call(
    rig: Rig, rollout_id: str, messages: list[dict[str, Any]], parent: CommitCoords | None, **params: Any
) -> tuple[dict[str, Any], CommitCoords]:
    """One captured call, as a rollout driver makes it."""
    admission = rig.admit(rollout_id, parent)
    response = chat(rig, rig.client.request_body({"messages": messages, **params}, admission))
    assert response.status_code == 200, response.text
    reply = response.json()
    coords = rig.client.coords_from_reply(reply)
    assert coords is not None
    return reply, coords


def assistant(reply: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The reply's message as an agent appends it to the conversation."""
    message = reply["choices"][0]["message"]
    kept = {"role": "assistant", "content": message["content"]}
    if message.get("tool_calls"):
        kept["tool_calls"] = message["tool_calls"]
    return {**kept, **extra}


def reasoned_tool_call(question: str) -> list[dict[str, Any]]:
    """A question, then an assistant turn that reasons inline and calls ``add``, and the
    tool's result: the turn is rendered with its <think> block while it follows the last
    user turn and stripped once a new user turn comes, so later renders of the history
    differ from the ids the engine saw."""
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "<think>\nI should call add.\n</think>\n\n", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"result": 5}'},
    ]


def test_reasoning_stripping_template_keeps_exact_prefixes(
    host: EngineHost, models: Models, oracle: HFOracle
) -> None:
    tools = TOOLS
    rig = start_rig(host, models.chatml, chat_template=reasoning_stripping_template())
    try:
        messages = reasoned_tool_call("What is 2 + 3? Use a tool.")
        plain_renders = []
        reply, coords = captured_call(rig, "r-strip", messages, None, tools=tools, **GREEDY)
        for question in ["Now multiply by 4.", "Thanks."]:
            messages += [
                assistant(reply, reasoning_content="The tool answered, so I report it."),
                {"role": "user", "content": question},
            ]
            plain_renders.append(rig.worker.renderer.render(messages, tools))
            reply, coords = captured_call(rig, "r-strip", messages, coords, tools=tools, **GREEDY)
            assert coords.disposition == "staged", coords
        event, sample = rig.finalize("r-strip")
    finally:
        rig.close()
    assert event.status == "accepted", event
    assert sample is not None and event.call_count == 3
    calls = rig.recorder.calls
    assert_sample_is_what_the_engine_saw(sample, [(call, 0) for call in calls])
    for parent, child, plain in zip(calls[:-1], calls[1:], plain_renders, strict=True):
        exact = parent.prompt_ids + parent.only.token_ids
        assert child.prompt_ids[: len(exact)] == exact
        assert plain[: len(exact)] != exact  # the template re-rendered history differently
    think = rig.worker.renderer.tokenizer.convert_tokens_to_ids("<think>")
    assert think in calls[0].prompt_ids and think in sample.token_ids
    assert think not in plain_renders[-1]
    assert_matches_hf(oracle, models.chatml, sample)


def with_system_switch(template: str) -> str:
    """The template with one more turn first (a brief system note) when the request's
    ``chat_template_kwargs`` say ``with_system``: a variable that changes the history's
    render, so a splice that ignored it would miscount the turns."""
    note = "{%- if with_system is true -%}{{- '<|im_start|>system\\nBe brief.<|im_end|>\\n' -}}{%- endif -%}"
    return note + template


def test_template_kwargs_are_honoured_under_capture(
    host: EngineHost, models: Models, oracle: HFOracle
) -> None:
    """``chat_template_kwargs`` reach the render of the history the splice counts turns in:
    each call's prompt is the exact prefix followed by exactly the template's new tail. The
    first call's reasoning is stripped from later renders, so those do not start with the
    exact prefix and the splice renders the history."""
    rig = start_rig(host, models.chatml, chat_template=with_system_switch(reasoning_stripping_template()))
    kwargs = {"chat_template_kwargs": {"with_system": True}}
    im_start = rig.worker.renderer.tokenizer.convert_tokens_to_ids("<|im_start|>")
    try:
        messages = reasoned_tool_call("Add 2 and 3.")
        reply, coords = captured_call(rig, "r-kwargs", messages, None, tools=TOOLS, **kwargs, **GREEDY)
        for question in ["Now multiply by 4.", "Thanks."]:
            messages += [assistant(reply), {"role": "user", "content": question}]
            reply, coords = captured_call(rig, "r-kwargs", messages, coords, tools=TOOLS, **kwargs, **GREEDY)
        event, sample = rig.finalize("r-kwargs")
    finally:
        rig.close()
    assert event.status == "accepted", event
    assert sample is not None and event.call_count == 3
    calls = rig.recorder.calls
    assert_sample_is_what_the_engine_saw(sample, [(call, 0) for call in calls])
    assert (
        calls[0].prompt_ids.count(im_start) == 6
    )  # the note, the tools' system turn, 3 messages, the reply's
    think = rig.worker.renderer.tokenizer.convert_tokens_to_ids("<think>")
    assert think in calls[0].prompt_ids and think in sample.token_ids  # kept exact, stripped in renders
    for parent, child in itertools.pairwise(calls):
        exact = parent.prompt_ids + parent.only.token_ids
        assert child.prompt_ids[: len(exact)] == exact
        assert child.prompt_ids[len(exact) :].count(im_start) == 2  # the new user turn, the reply's
    assert_matches_hf(oracle, models.chatml, sample)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_the_sampled_logprob_path_equals_vllms_own_logprobs(
    host: EngineHost, models: Models, stream: bool
) -> None:
    """A captured call whose client asked for no logprobs keeps only the sampled float
    (``SampledLogprobs``); the same call asking for ``logprobs`` (top 0) goes through
    vLLM's whole logprob output. Sampled with a seed, both draw the same tokens, and every
    token's logprob is the same float, equal to what vLLM's reply lists."""
    rig = start_rig(host, models.chatml)
    sampled = {
        "temperature": 0.9,
        "top_p": 0.95,
        "seed": 11,
        "max_tokens": 24,
        "ignore_eos": True,
        "stream": stream,
    }
    messages = [{"role": "user", "content": "Add 2 and 3."}]
    rows, listed = [], []
    hook = rig.worker.client.sampled_logprobs
    assert hook is not None
    replaced = hook.replaced
    try:
        for asked in (False, True):
            extra = {"logprobs": True, "top_logprobs": 0} if asked else {}
            admission = rig.admit(f"r-logprob-{asked}")
            response = chat(
                rig, rig.client.request_body({"messages": messages, **sampled, **extra}, admission)
            )
            assert response.status_code == 200, response.text
            if stream:
                chunks = [
                    orjson.loads(line[len("data: ") :])
                    for line in response.text.splitlines()
                    if line.startswith("data: {")
                ]
                coords = CommitCoords.model_validate(chunks[-1][COORDS_FIELD])
                content = [
                    e
                    for c in chunks
                    for ch in c["choices"]
                    for e in ((ch.get("logprobs") or {}).get("content") or [])
                ]
            else:
                reply = response.json()
                coords = CommitCoords.model_validate(reply[COORDS_FIELD])
                content = (reply["choices"][0].get("logprobs") or {}).get("content") or []
            row = rig.data_plane.calls[coords.staging_key]
            rows.append((row.token_ids_delta[row.token_mask_delta.index(1.0) :], row.logprobs_delta))
            listed.append([entry["logprob"] for entry in content])
    finally:
        rig.close()
    (ids_sampled, lp_sampled), (ids_vllm, lp_vllm) = rows
    assert ids_sampled == ids_vllm and len(ids_sampled) == 24
    generated = len(ids_sampled)
    assert lp_sampled[-generated:] == lp_vllm[-generated:]  # the same float32, token for token
    assert listed[0] == [] and lp_vllm[-generated:] == pytest.approx(listed[1], abs=1e-6)
    assert hook.replaced == replaced + 1  # the call that asked kept vLLM's path


def test_plain_requests_and_malformed_capture(host: EngineHost, models: Models) -> None:
    rig = start_rig(host, models.chatml)
    try:
        messages = [{"role": "user", "content": "Add 2 and 3."}]
        plain = chat(rig, {"messages": messages, **GREEDY})
        assert plain.status_code == 200, plain.text
        body = plain.json()
        assert COORDS_FIELD not in body and token_keys(body) == set()
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["usage"]["completion_tokens"] == GREEDY["max_tokens"]
        assert rig.worker_sink.events == [] and rig.data_plane.calls == {}

        reply, first = captured_call(rig, "r-bad", messages, None, **GREEDY)
        published = len(rig.worker_sink.events)
        rows = dict(rig.data_plane.calls)
        follow_up = [*messages, assistant(reply), {"role": "user", "content": "And 4 * 5?"}]
        good = rig.client.admit("r-bad", first).model_dump(mode="json")
        broken: list[tuple[Any, str]] = [
            ({**good, "staging_chain": []}, "ng_capture.staging_chain"),
            ({**good, "prev_len": -1}, "ng_capture.prev_len"),
            ({**good, "rollout_id": "r/bad"}, "ng_capture.rollout_id"),
            ({**good, "surprise": 1}, "ng_capture.surprise"),
            ("not an admission", "ng_capture"),
        ]
        for capture, param in broken:
            response = chat(rig, {"messages": follow_up, **GREEDY, CAPTURE_FIELD: capture})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == param and param in error["message"], error
        assert len(rig.worker_sink.events) == published and rig.data_plane.calls == rows

        rig.publish([CaptureAdmission.model_validate(good)])
        response = chat(rig, {"messages": follow_up, **GREEDY, CAPTURE_FIELD: good})
        assert response.status_code == 200, response.text
        second = rig.client.coords_from_reply(response.json())
        assert second is not None and second.disposition == "staged" and second.prev_len == first.cum_len
        event, sample = rig.finalize("r-bad")
        assert event.status == "accepted" and event.call_count == 2, event
        last = rig.recorder.calls[-1]
        assert sample is not None and sample.token_ids == last.prompt_ids + last.only.token_ids

        health = httpx.get(f"{rig.url}/health", timeout=10).json()
        assert health["status"] == "ok" and health["writer_backlog"] == 0
        metrics = httpx.get(f"{rig.url}/metrics", timeout=10).text
        assert 'tokentrail_worker_captured_calls_total{worker="w-test"} 2.0' in metrics
        assert 'tokentrail_worker_rejected_requests_total{worker="w-test"} 5.0' in metrics
    finally:
        rig.close()


def test_refit_mid_call_records_two_weight_spans(host: EngineHost, models: Models, oracle: HFOracle) -> None:
    max_tokens = 400
    rig = start_rig(host, models.chatml)

    async def refit() -> dict[str, Any]:
        """Once tokens flow, the refit sequence through the admin routes; the state after it."""
        await rig.recorder.submitted.wait()
        await asyncio.sleep(0.2)  # let some tokens come from version 0
        async with httpx.AsyncClient(base_url=rig.url, timeout=60) as http:
            for path, body in [
                ("/admin/pause", None),
                ("/admin/reload_weights", {"path": str(models.refit)}),
                ("/admin/weight_version", {"version": 1}),
                ("/admin/resume", None),
            ]:
                response = await http.post(path, json=body)
                assert response.status_code == 200, (path, response.text)
            state: dict[str, Any] = (await http.get("/admin/weight_version")).json()
            return state

    async def restore() -> None:
        """Give the module's engine its seed-0 weights back (vLLM's own RL endpoints)."""
        async with httpx.AsyncClient(base_url=rig.url, timeout=60) as http:
            assert (await http.post("/pause", params={"mode": "keep"})).status_code == 200
            await host.engine.reload_weights(str(models.chatml))
            response = await http.post("/update_weight_version", json={"new_version": "0"})
            assert response.status_code == 200, response.text
            assert (await http.post("/resume")).status_code == 200

    try:
        refitting = asyncio.run_coroutine_threadsafe(refit(), host.loop)
        messages = [{"role": "user", "content": "Count to a hundred."}]
        _, coords = captured_call(
            rig, "r-refit", messages, None, temperature=0.0, max_tokens=max_tokens, ignore_eos=True
        )
        state = refitting.result(60)
        extras = rig.data_plane.calls[coords.staging_key].extras  # the finalizer deletes the row
        event, sample = rig.finalize("r-refit")
        straddles = rig.worker.capture_counters.refit_straddles
    finally:
        host.run(restore())
        rig.close()
    assert state == {"version": 1, "paused": False}
    assert coords.disposition == "staged" and coords.weight_version == 0
    generation = rig.recorder.calls[0].only
    assert len(generation.token_ids) == max_tokens
    assert [span[0] for span in generation.spans] == ["0", "1"]
    boundary = generation.spans[1][1]
    assert 0 < boundary < max_tokens
    assert event.status == "accepted" and sample is not None
    assert (event.min_weight_version, event.max_weight_version) == (0, 1)
    prompt_len = len(rig.recorder.calls[0].prompt_ids)
    assert sample.weight_versions == [0] * (prompt_len + boundary) + [1] * (max_tokens - boundary)
    assert extras == {EXTRAS_WEIGHT_SPANS: [[0, 0], [boundary, 1]], "sampling": {"temperature": 0.0}}
    assert straddles == 1
    # Tokens before the boundary follow the old weights, tokens from it on the new ones.
    old = oracle.log_softmax(models.chatml, sample.token_ids)
    new = oracle.log_softmax(models.refit, sample.token_ids)
    for offset in range(max_tokens):
        i = prompt_len + offset
        log_probs = old if offset < boundary else new
        assert int(log_probs[i - 1].argmax()) == sample.token_ids[i], offset
        assert abs(float(log_probs[i - 1, sample.token_ids[i]]) - sample.logprobs[i]) <= LOGPROB_TOL, offset
    # The mismatch report of a trainer holding the new weights puts the call in the
    # straddled bucket: exact on the tokens of its own version, off on the older ones.
    from transformers import AutoModelForCausalLM

    from pipeline.trainer.recompute import measure
    from stages.finalize.reader import FinalizedRollout, Group
    from stages.trainer.batch import build_batch
    from stages.trainer.mismatch import Bounds
    from stages.trainer.staleness import StalenessPolicy

    batch = build_batch(
        [Group("g", [FinalizedRollout(event, (sample,))])], policy_version=1, staleness=StalenessPolicy()
    )
    report, _ = measure(
        AutoModelForCausalLM.from_pretrained(str(models.refit)), batch, policy_version=1, bounds=Bounds()
    )
    assert (
        report["buckets"]["straddled"]["tokens"] == max_tokens and report["buckets"]["clean"]["tokens"] == 0
    )
    lag = report["buckets"]["lag"]
    assert lag["0"]["tokens"] == max_tokens - boundary and lag["0"]["max_abs_dev"] <= LOGPROB_TOL, lag
    assert lag["1"]["tokens"] == boundary and lag["1"]["max_abs_dev"] > 1e-2, lag
    assert all(worst["straddled"] and worst["lag"] == 1 for worst in report["worst"])


TRUNCATED: dict[str, Any] = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}


def processed_logprobs(oracle: HFOracle, model_dir: Path, ids: list[int], options: dict[str, Any]) -> Any:
    """An independent processed distribution per position: HF's logits through vLLM's own
    temperature division and top-k/top-p op (``apply_top_k_top_p_pytorch``)."""
    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    logits = oracle.log_softmax(model_dir, ids) / options["temperature"]
    n = len(ids)
    filtered = apply_top_k_top_p_pytorch(
        logits.clone(), torch.full((n,), options["top_k"]), torch.full((n,), options["top_p"])
    )
    return filtered.log_softmax(-1), torch.log_softmax(logits, -1)


def test_truncated_sampling_is_recorded_and_replayed_exactly(
    host: EngineHost, models: Models, oracle: HFOracle
) -> None:
    """Two captured turns at temperature 0.7, top-p 0.8, top-k 20: each span carries those
    options, every logprob is of the processed distribution an HF forward gives, and the
    built-in trainer's replay recomputes them; without the replay the ratio is off by log S."""
    from pipeline.trainer.grpo import GrpoTrainer
    from stages.finalize.reader import FinalizedRollout, Group
    from stages.trainer.batch import build_batch
    from stages.trainer.staleness import StalenessPolicy

    rig = start_rig(host, models.chatml)
    try:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Add 2 and 3."}]
        reply, coords = captured_call(rig, "r-trunc", messages, None, max_tokens=12, seed=5, **TRUNCATED)
        messages += [assistant(reply), {"role": "user", "content": "And then 4?"}]
        captured_call(rig, "r-trunc", messages, coords, max_tokens=12, seed=6, **TRUNCATED)
        event, sample = rig.finalize("r-trunc")
    finally:
        rig.close()
    assert event.status == "accepted" and sample is not None
    assert [span.sampling.extras() if span.sampling else None for span in sample.spans] == [TRUNCATED] * 2
    processed, plain = processed_logprobs(oracle, models.chatml, sample.token_ids, TRUNCATED)
    positions = [i for i, m in enumerate(sample.token_mask) if m == 1.0]
    bias = 0.0
    for i in positions:
        token = sample.token_ids[i]
        assert abs(float(processed[i - 1, token]) - sample.logprobs[i]) <= 1e-4, i
        bias = max(bias, abs(float(plain[i - 1, token]) - sample.logprobs[i]))
    assert bias > 1e-2  # the unprocessed distribution is measurably another one
    batch = build_batch(
        [Group("g", [FinalizedRollout(event, (sample,))])], policy_version=0, staleness=StalenessPolicy()
    )
    report = GrpoTrainer(models.chatml).step(batch)
    assert report.ratio_max_abs_dev <= 1e-4, report
    assert report.mismatch is not None and report.mismatch["provenance_unknown_tokens"] == 0
    assert report.mismatch["mean_log_kept"] < 0  # the truncation removed mass, and the replay accounts it
    # A bf16 trainer against the fp32 engine: a known, non-zero mismatch, in the clean bucket.
    bf16 = GrpoTrainer(models.chatml, dtype="bfloat16").step(batch).mismatch
    assert bf16 is not None and bf16["k3"] > 1e-7 and bf16["max_abs_dev"] > 1e-3, bf16
    assert bf16["buckets"]["clean"]["tokens"] == bf16["tokens"]
