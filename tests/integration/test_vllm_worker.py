"""The vLLM worker end to end on a real engine: HTTP in, captured rows, finalized samples.

One vLLM CPU engine serves the whole module. vLLM's async engine belongs to the event
loop it was created in, so the engine lives in a dedicated thread's loop and every test
runs its async body there (``EngineHost.run``). Each test builds its own worker, app
and in-memory ports around that engine; the driver side is ``RolloutClient``, and its
events plus the worker's go through the real ledger and finalizer stages.

Oracle: a Hugging Face fp32 forward of the same tiny model. The seed-0 tiny model with
the reasoning-stripping template has the same weights and tokenizer as the ChatML one
(only the template differs, and templates run in the worker), so one engine serves both.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from pipeline.models.tiny import make_tiny_model
from pipeline.worker.main import WorkerConfig, build_worker
from pipeline.worker.server import create_app
from stages.capture.core import AckPolicy
from stages.capture.engine import Generation, Sampling
from stages.capture.vllm.engine import EngineSettings, VllmEngine
from stages.capture.vllm.worker import VllmWorker
from stages.client import RolloutClient
from stages.finalize.stage import FinalizerStage
from stages.ledger.stage import LedgerConfig, LedgerStage
from stages.memory import MemoryDataPlane, RecordingSink
from stages.ports import Consumed
from topics.events import envelope
from topics.records import (
    EXTRAS_WEIGHT_SPANS,
    CaptureAdmission,
    CommitCoords,
    FinalizedEvent,
    Record,
    RolloutReceipt,
    RolloutSeal,
    StagedEvent,
    TrainingSample,
)
from topics.wire import COORDS_FIELD, TOKEN_FIELDS

pytestmark = [pytest.mark.slow, pytest.mark.engine]

T = TypeVar("T")
LOGPROB_TOL = 1e-4


@dataclass(frozen=True)
class Models:
    chatml: Path
    strip: Path
    refit: Path  # seed 1: same tokenizer, other weights


class EngineHost:
    """One engine on its own thread's event loop; tests submit coroutines to it."""

    def __init__(self, settings: EngineSettings) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vllm-engine-loop", daemon=True)
        self.thread.start()
        self.engine: VllmEngine = self.run(self._start(settings), timeout=300)

    @staticmethod
    async def _start(settings: EngineSettings) -> VllmEngine:
        return VllmEngine.start(settings)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.engine.shutdown)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(60)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    root = tmp_path_factory.mktemp("models")
    return Models(
        chatml=make_tiny_model(root / "chatml", seed=0),
        strip=make_tiny_model(root / "strip", seed=0, template="strip_reasoning"),
        refit=make_tiny_model(root / "refit", seed=1),
    )


@pytest.fixture(scope="module")
def host(models: Models) -> Iterator[EngineHost]:
    engine_host = EngineHost(EngineSettings(model=str(models.chatml)))
    try:
        yield engine_host
    finally:
        engine_host.close()


class HFOracle:
    """Per-position log-softmax of a Hugging Face fp32 forward, models loaded once."""

    def __init__(self) -> None:
        self._models: dict[Path, Any] = {}

    def log_softmax(self, model_dir: Path, ids: Sequence[int]) -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        if model_dir not in self._models:
            model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
            self._models[model_dir] = model.eval()
        with torch.no_grad():
            logits = self._models[model_dir](torch.tensor([list(ids)])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="module")
def oracle() -> HFOracle:
    return HFOracle()


@dataclass
class EngineCall:
    prompt_ids: list[int]
    generation: Generation


class RecordingEngine:
    """The shared engine, remembering the exact ids of every call (and never shutting it down)."""

    def __init__(self, engine: VllmEngine) -> None:
        self.engine = engine
        self.calls: list[EngineCall] = []
        self.submitted = asyncio.Event()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling, request_id: str) -> Generation:
        self.submitted.set()
        generation = await self.engine.generate(prompt_ids, sampling, request_id)
        self.calls.append(EngineCall(list(prompt_ids), generation))
        return generation

    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()

    async def reload_weights(self, path: str) -> None:
        await self.engine.reload_weights(path)

    async def set_weight_version(self, version: str) -> None:
        await self.engine.set_weight_version(version)

    def unfinished_requests(self) -> int:
        return self.engine.unfinished_requests()

    def shutdown(self) -> None:
        pass


@dataclass
class Harness:
    """A worker on in-memory ports behind its FastAPI app, and a driver on its own sink."""

    engine: RecordingEngine
    worker: VllmWorker
    http: httpx.AsyncClient
    data_plane: MemoryDataPlane
    worker_sink: RecordingSink
    driver_sink: RecordingSink
    client: RolloutClient
    replies: list[dict[str, Any]] = field(default_factory=list)

    async def call(
        self,
        rollout_id: str,
        messages: list[dict[str, Any]],
        parent: CommitCoords | None,
        **params: Any,
    ) -> tuple[dict[str, Any], CommitCoords]:
        """One captured call, as a rollout driver makes it."""
        admission = self.client.admit(rollout_id, parent)
        await self.client.publish_admission(admission)
        body = self.client.request_body({"model": "tiny", "messages": messages, **params}, admission)
        response = await self.http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        reply = response.json()
        self.replies.append(reply)
        coords = self.client.coords_from_reply(reply)
        assert coords is not None
        return reply, coords

    async def finalize(self, rollout_id: str) -> tuple[FinalizedEvent, TrainingSample | None]:
        """Seal, then run the ledger and the finalizer over everything published."""
        await self.client.seal(rollout_id)
        driver = [e.payload for e in self.driver_sink.events]
        staged = [e.payload for e in self.worker_sink.events]
        ordered: list[Record] = [
            *(p for p in driver if isinstance(p, CaptureAdmission)),
            *staged,
            *(p for p in driver if isinstance(p, RolloutSeal)),
        ]
        ledger_out = RecordingSink()
        ledger = LedgerStage(ledger_out, LedgerConfig())
        await ledger.handle([Consumed("in", 0, i, envelope(e)) for i, e in enumerate(ordered)])
        await ledger.tick(math.inf)  # the log is over (its events all stamped 0): close what is left
        receipts = [
            r
            for r in ledger_out.payloads(RolloutReceipt)
            if isinstance(r, RolloutReceipt) and r.rollout_id == rollout_id
        ]
        assert len(receipts) == 1
        final_out = RecordingSink()
        await FinalizerStage(self.data_plane, final_out).handle([Consumed("c", 0, 0, envelope(receipts[0]))])
        (event,) = final_out.payloads(FinalizedEvent)
        assert isinstance(event, FinalizedEvent)
        return event, self.data_plane.samples.get(rollout_id)


async def harness(
    host: EngineHost, model_dir: Path, *, ack: AckPolicy = AckPolicy.STAGED
) -> tuple[Harness, VllmWorker]:
    engine = RecordingEngine(host.engine)
    data_plane, worker_sink, driver_sink = MemoryDataPlane(), RecordingSink(), RecordingSink()
    config = WorkerConfig(model_dir=model_dir, worker_id="w-test", ack_policy=ack)
    worker = build_worker(config, engine, data_plane, worker_sink)
    await worker.start()
    app = create_app(worker, model_name="tiny", worker_id="w-test", manage_worker=False)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker", timeout=120)
    h = Harness(engine, worker, http, data_plane, worker_sink, driver_sink, RolloutClient(driver_sink))
    return h, worker


async def close(h: Harness) -> None:
    await h.http.aclose()
    await h.worker.stop()


def token_keys(value: Any) -> set[str]:
    """Every key at any depth of a JSON value that carries tokens."""
    if isinstance(value, dict):
        found = {k for k in value if k in TOKEN_FIELDS}
        for item in value.values():
            found |= token_keys(item)
        return found
    if isinstance(value, list):
        return set().union(*(token_keys(item) for item in value)) if value else set()
    return set()


def assistant(reply: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The reply's message as the driver appends it to the conversation."""
    message = dict(reply["choices"][0]["message"])
    return {k: v for k, v in {**message, **extra}.items() if v is not None}


def assert_sample_is_what_the_engine_saw(sample: TrainingSample, calls: list[EngineCall]) -> None:
    """Each call's prompt is exactly the sample's ids before its generation, which follows it."""
    mask_ones = 0
    for call in calls:
        n, gen = len(call.prompt_ids), call.generation
        assert sample.token_ids[:n] == call.prompt_ids
        assert sample.token_ids[n : n + len(gen.token_ids)] == gen.token_ids
        assert sample.logprobs[n : n + len(gen.token_ids)] == pytest.approx(gen.logprobs, abs=1e-7)
        assert sample.token_mask[n : n + len(gen.token_ids)] == [1.0] * len(gen.token_ids)
        mask_ones += len(gen.token_ids)
    last = calls[-1]
    assert sample.token_ids == last.prompt_ids + last.generation.token_ids
    assert sum(sample.token_mask) == mask_ones


def assert_matches_hf(oracle: HFOracle, model_dir: Path, sample: TrainingSample) -> None:
    """Greedy ids are the HF argmax and logprobs the HF log-softmax, at every generated position."""
    log_probs = oracle.log_softmax(model_dir, sample.token_ids)
    positions = [i for i, m in enumerate(sample.token_mask) if m == 1.0]
    assert positions and positions[0] > 0
    for i in positions:
        assert int(log_probs[i - 1].argmax()) == sample.token_ids[i], f"position {i}"
        assert abs(float(log_probs[i - 1, sample.token_ids[i]]) - sample.logprobs[i]) <= LOGPROB_TOL, i


GREEDY = {"temperature": 0.0, "max_tokens": 12}


def test_three_turns_capture_exact_ids_and_hf_logprobs(
    host: EngineHost, models: Models, oracle: HFOracle
) -> None:
    async def go() -> tuple[Harness, FinalizedEvent, TrainingSample | None, list[CommitCoords]]:
        h, _ = await harness(host, models.chatml)
        try:
            messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 3?"}]
            coords: CommitCoords | None = None
            all_coords = []
            for turn, question in enumerate(["And 4 * 5?", "Thanks, bye."]):
                reply, coords = await h.call("r-three", messages, coords, **GREEDY)
                all_coords.append(coords)
                messages += [assistant(reply), {"role": "user", "content": question}]
                assert turn < 2
            reply, coords = await h.call("r-three", messages, coords, **GREEDY)
            all_coords.append(coords)
            event, sample = await h.finalize("r-three")
            return h, event, sample, all_coords
        finally:
            await close(h)

    h, event, sample, coords = host.run(go())
    assert event.status == "accepted", event
    assert event.call_count == 3 and sample is not None
    assert [c.disposition for c in coords] == ["staged"] * 3
    assert [c.mode for c in coords] == ["text", "token_in", "token_in"]
    assert_sample_is_what_the_engine_saw(sample, h.engine.calls)
    assert_matches_hf(oracle, models.chatml, sample)
    for reply, c in zip(h.replies, coords, strict=True):
        assert token_keys(reply) == set()
        assert reply["id"].startswith("chatcmpl-")
        assert reply[COORDS_FIELD]["digest"] == c.digest
    staged = [e.payload for e in h.worker_sink.events]
    assert all(isinstance(p, StagedEvent) for p in staged)
    assert [p.response_id for p in staged] == [r["id"] for r in h.replies]  # type: ignore[attr-defined]


def test_reasoning_stripping_template_keeps_exact_prefixes(
    host: EngineHost, models: Models, oracle: HFOracle
) -> None:
    tool_call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
    }
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]

    async def go() -> tuple[Harness, FinalizedEvent, TrainingSample | None, list[list[int]]]:
        h, worker = await harness(host, models.strip)
        try:
            # An earlier assistant turn reasons inline and calls a tool: rendered with its
            # <think> block while it follows the last user turn, stripped once a new user
            # turn comes, so the re-rendered history differs from the ids the engine saw.
            messages: list[dict[str, Any]] = [
                {"role": "user", "content": "What is 2 + 3? Use a tool."},
                {
                    "role": "assistant",
                    "content": "<think>\nI should call add.\n</think>\n\n",
                    "tool_calls": [tool_call],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": '{"result": 5}'},
            ]
            plain_renders = []
            reply, coords = await h.call("r-strip", messages, None, tools=tools, **GREEDY)
            for question in ["Now multiply by 4.", "Thanks."]:
                messages += [
                    assistant(reply, reasoning_content="The tool answered, so I report it."),
                    {"role": "user", "content": question},
                ]
                plain_renders.append(worker.renderer.render(messages, tools))
                reply, coords = await h.call("r-strip", messages, coords, tools=tools, **GREEDY)
                assert coords.disposition == "staged", coords
            event, sample = await h.finalize("r-strip")
            return h, event, sample, plain_renders
        finally:
            await close(h)

    h, event, sample, plain_renders = host.run(go())
    assert event.status == "accepted", event
    assert sample is not None and event.call_count == 3
    calls = h.engine.calls
    assert_sample_is_what_the_engine_saw(sample, calls)
    for parent, child, plain in zip(calls[:-1], calls[1:], plain_renders, strict=True):
        exact = parent.prompt_ids + parent.generation.token_ids
        assert child.prompt_ids[: len(exact)] == exact
        assert plain[: len(exact)] != exact  # the template re-rendered history differently
    think = h.worker.renderer.tokenizer.convert_tokens_to_ids("<think>")
    assert think in calls[0].prompt_ids and think in sample.token_ids
    assert think not in plain_renders[-1]
    assert_matches_hf(oracle, models.strip, sample)


def test_plain_requests_and_malformed_capture(host: EngineHost, models: Models) -> None:
    async def go() -> None:
        h, _ = await harness(host, models.chatml)
        try:
            messages = [{"role": "user", "content": "Add 2 and 3."}]
            plain = await h.http.post("/v1/chat/completions", json={"messages": messages, **GREEDY})
            assert plain.status_code == 200, plain.text
            body = plain.json()
            assert COORDS_FIELD not in body and token_keys(body) == set()
            assert body["choices"][0]["message"]["role"] == "assistant"
            assert body["usage"]["completion_tokens"] == GREEDY["max_tokens"]
            assert h.worker_sink.events == [] and h.data_plane.calls == {}

            many = await h.http.post("/v1/chat/completions", json={"messages": messages, "n": 2})
            assert many.status_code == 400 and many.json()["error"]["param"] == "n"

            reply, first = await h.call("r-bad", messages, None, **GREEDY)
            published = len(h.worker_sink.events)
            rows = dict(h.data_plane.calls)
            follow_up = [*messages, assistant(reply), {"role": "user", "content": "And 4 * 5?"}]
            good = h.client.admit("r-bad", first).model_dump(mode="json")
            broken: list[tuple[Any, str]] = [
                ({**good, "staging_chain": []}, "ng_capture.staging_chain"),
                ({**good, "prev_len": -1}, "ng_capture.prev_len"),
                ({**good, "rollout_id": "r/bad"}, "ng_capture.rollout_id"),
                ({**good, "surprise": 1}, "ng_capture.surprise"),
                ("not an admission", "ng_capture"),
            ]
            for capture, param in broken:
                response = await h.http.post(
                    "/v1/chat/completions", json={"messages": follow_up, **GREEDY, "ng_capture": capture}
                )
                assert response.status_code in (400, 422), response.text
                error = response.json()["error"]
                assert error["param"] == param and param in error["message"], error
            assert len(h.worker_sink.events) == published and h.data_plane.calls == rows

            await h.client.publish_admission(CaptureAdmission.model_validate(good))
            response = await h.http.post(
                "/v1/chat/completions", json={"messages": follow_up, **GREEDY, "ng_capture": good}
            )
            assert response.status_code == 200, response.text
            second = h.client.coords_from_reply(response.json())
            assert second is not None and second.disposition == "staged" and second.prev_len == first.cum_len
            event, sample = await h.finalize("r-bad")
            assert event.status == "accepted" and event.call_count == 2, event
            assert sample is not None and sample.token_ids == (
                h.engine.calls[-1].prompt_ids + h.engine.calls[-1].generation.token_ids
            )

            health = (await h.http.get("/health")).json()
            assert health["status"] == "ok" and health["writer_backlog"] == 0
            metrics = (await h.http.get("/metrics")).text
            assert 'tokentrail_worker_captured_calls_total{worker="w-test"} 2.0' in metrics
            assert "tokentrail_worker_writer_backlog" in metrics
        finally:
            await close(h)

    host.run(go())


def test_refit_mid_call_records_two_weight_spans(host: EngineHost, models: Models, oracle: HFOracle) -> None:
    max_tokens = 400

    async def go() -> tuple[
        Harness, CommitCoords, FinalizedEvent, TrainingSample | None, dict[str, Any], Any
    ]:
        h, _ = await harness(host, models.chatml)
        try:

            async def refit() -> None:
                await h.engine.submitted.wait()
                await asyncio.sleep(0.2)  # let some tokens come from version 0
                for path, body in [
                    ("/admin/pause", None),
                    ("/admin/reload_weights", {"path": str(models.refit)}),
                    ("/admin/weight_version", {"version": 1}),
                    ("/admin/resume", None),
                ]:
                    response = await h.http.post(path, json=body)
                    assert response.status_code == 200, (path, response.text)

            task = asyncio.create_task(refit())
            messages = [{"role": "user", "content": "Count to a hundred."}]
            _, coords = await h.call(
                "r-refit", messages, None, temperature=0.0, max_tokens=max_tokens, ignore_eos=True
            )
            await task
            state = (await h.http.get("/admin/weight_version")).json()
            extras = h.data_plane.calls[coords.staging_key].extras  # the finalizer deletes the row
            event, sample = await h.finalize("r-refit")
            return h, coords, event, sample, state, extras
        finally:
            await close(h)
            # Give the module's engine its seed-0 weights back.
            await host.engine.pause()
            await host.engine.reload_weights(str(models.chatml))
            await host.engine.set_weight_version("0")
            await host.engine.resume()

    h, coords, event, sample, state, extras = host.run(go())
    assert state == {"version": 1, "paused": False}
    assert coords.disposition == "staged" and coords.weight_version == 0
    generation = h.engine.calls[0].generation
    assert len(generation.token_ids) == max_tokens
    assert [span.version for span in generation.version_spans] == ["0", "1"]
    boundary = generation.version_spans[1].start
    assert 0 < boundary < max_tokens
    assert event.status == "accepted" and sample is not None
    assert (event.min_weight_version, event.max_weight_version) == (0, 1)
    prompt_len = len(h.engine.calls[0].prompt_ids)
    assert sample.weight_versions == [0] * (prompt_len + boundary) + [1] * (max_tokens - boundary)
    assert extras == {EXTRAS_WEIGHT_SPANS: [[0, 0], [boundary, 1]]}
    metrics_seen = h.worker.counters.refit_straddles
    assert metrics_seen == 1
    # Tokens before the boundary follow the old weights, tokens from it on the new ones.
    old = oracle.log_softmax(models.chatml, sample.token_ids)
    new = oracle.log_softmax(models.refit, sample.token_ids)
    for offset in range(max_tokens):
        i = prompt_len + offset
        log_probs = old if offset < boundary else new
        assert int(log_probs[i - 1].argmax()) == sample.token_ids[i], offset
        assert abs(float(log_probs[i - 1, sample.token_ids[i]]) - sample.logprobs[i]) <= LOGPROB_TOL, offset
