"""A real vLLM worker for tests: one CPU engine per module, workers served over real HTTP.

vLLM's async engine belongs to the event loop it was created in, so the engine lives in
a dedicated thread's loop (``EngineHost``) and every worker serves there on a real
uvicorn socket; tests talk to it with real clients (httpx, the official SDKs) from the
test thread. ``RecordingLLM`` sits between the capturing client and vLLM and remembers
the exact prompt ids, generated ids and sampled logprobs of every engine request: the
oracle every captured sample is checked against. ``finalize`` runs the real ledger and
finalizer stages over everything the driver and the worker published.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from pipeline.worker.main import WorkerConfig, WorkerServer, build_app, build_worker
from stages.capture.core import AckPolicy
from stages.capture.vllm.engine import EngineSettings, VllmEngine
from stages.client import RolloutClient
from stages.finalize.stage import FinalizerStage
from stages.ledger.stage import LedgerConfig, LedgerStage
from stages.memory import MemoryDataPlane, RecordingSink
from stages.ports import Consumed, EventSink
from topics.events import envelope
from topics.records import (
    CaptureAdmission,
    FinalizedEvent,
    Record,
    RolloutReceipt,
    RolloutSeal,
    TrainingSample,
)
from topics.wire import TOKEN_FIELDS

T = TypeVar("T")
LOGPROB_TOL = 1e-4


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


@dataclass
class ChoiceRecord:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    spans: list[tuple[str, int, int]] = field(default_factory=list)


@dataclass
class EngineCall:
    """One engine request as the engine saw it: exact prompt ids and each choice's output."""

    prompt_ids: list[int]
    choices: dict[int, ChoiceRecord] = field(default_factory=dict)
    params: Any = None
    """The sampling parameters it ran with (logit bias, structured outputs), to run it again."""
    options: dict[str, Any] = field(default_factory=dict)
    """The rest of the request (``reasoning_parser_kwargs``, ...), to run it again."""

    @property
    def only(self) -> ChoiceRecord:
        assert len(self.choices) == 1, self.choices
        return self.choices[0]


class RecordingLLM:
    """vLLM's engine client, remembering every request (delegates everything else)."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm
        self.calls: list[EngineCall] = []
        self.submitted = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    async def generate(
        self, prompt: Any, params: Any, request_id: str, *args: Any, **kwargs: Any
    ) -> AsyncIterator[Any]:
        call = EngineCall(
            [int(t) for t in prompt.get("prompt_token_ids") or ()], params=params, options=kwargs
        )
        self.calls.append(call)
        self.submitted.set()
        delta = str(getattr(params.output_kind, "name", "")) == "DELTA"
        async for output in self._llm.generate(prompt, params, request_id, *args, **kwargs):
            for completion in output.outputs:
                record = call.choices.setdefault(int(completion.index), ChoiceRecord())
                ids = [int(t) for t in completion.token_ids]
                # The sampled float itself on capture's sampled path, else vLLM's entry per token.
                values = [
                    e if isinstance(e, float) else float(e[t].logprob)
                    for e, t in zip(completion.logprobs or [], ids, strict=False)
                ]
                if not delta:
                    record.token_ids, record.logprobs = [], []
                record.token_ids += ids
                record.logprobs += values
                record.finish_reason = completion.finish_reason
                for span in getattr(completion, "weight_versions", None) or ():
                    record.spans.append((str(span.version), int(span.start), int(span.end)))
            yield output


@dataclass
class Rig:
    """A worker on in-memory ports behind a real HTTP server, and a driver on its own sink."""

    host: EngineHost
    recorder: RecordingLLM
    server: WorkerServer
    data_plane: MemoryDataPlane
    worker_sink: RecordingSink
    driver_sink: RecordingSink
    client: RolloutClient
    worker: Any

    @property
    def url(self) -> str:
        return self.server.url

    def admit(self, rollout_id: str, parent: Any = None, **kw: Any) -> CaptureAdmission:
        """An admission, published as the driver does."""
        admission = self.client.admit(rollout_id, parent, **kw)
        self.host.run(self.client.publish_admission(admission))
        return admission

    def publish(self, admissions: Sequence[CaptureAdmission]) -> None:
        for admission in admissions:
            self.host.run(self.client.publish_admission(admission))

    def finalize(
        self, rollout_id: str, *, sealed: bool = False, **seal: Any
    ) -> tuple[FinalizedEvent, TrainingSample | None]:
        """Seal (unless someone else did: ``sealed``), then run the ledger and the finalizer."""
        return self.host.run(self._finalize(rollout_id, None if sealed else seal))

    async def _finalize(
        self, rollout_id: str, seal: dict[str, Any] | None
    ) -> tuple[FinalizedEvent, TrainingSample | None]:
        await settled(self.worker.core.writer)
        if seal is not None:
            await self.client.seal(rollout_id, **seal)
        published = [e.payload for e in self.driver_sink.events] + [
            e.payload for e in self.worker_sink.events
        ]
        return await finalize_events(published, self.data_plane, rollout_id)

    def close(self) -> None:
        self.host.run(self.server.stop())


async def finalize_events(
    published: Sequence[Record], data_plane: Any, rollout_id: str
) -> tuple[FinalizedEvent, TrainingSample | None]:
    """The real ledger and finalizer over ``published`` (admissions, staged events, seals)."""
    ordered: list[Record] = [
        *(p for p in published if isinstance(p, CaptureAdmission)),
        *(p for p in published if not isinstance(p, CaptureAdmission | RolloutSeal)),
        *(p for p in published if isinstance(p, RolloutSeal)),
    ]
    ledger_out = RecordingSink()
    ledger = LedgerStage(ledger_out, LedgerConfig())
    await ledger.handle([Consumed("in", 0, i, envelope(e)) for i, e in enumerate(ordered)])
    await ledger.tick(math.inf)  # the log is over: close what is left
    receipts = [
        r
        for r in ledger_out.payloads(RolloutReceipt)
        if isinstance(r, RolloutReceipt) and r.rollout_id == rollout_id
    ]
    assert len(receipts) == 1, ledger_out.events
    final_out = RecordingSink()
    await FinalizerStage(data_plane, final_out).handle([Consumed("c", 0, 0, envelope(receipts[0]))])
    (event,) = final_out.payloads(FinalizedEvent)
    assert isinstance(event, FinalizedEvent)
    return event, data_plane.samples.get(rollout_id)


class TeeSink(RecordingSink):
    """Records every event and publishes it to another sink too."""

    def __init__(self, also: EventSink) -> None:
        super().__init__()
        self.also = also

    async def publish(self, records: Sequence[Record]) -> None:
        await self.also.publish(records)
        await super().publish(records)


async def settled(writer: Any) -> None:
    """Until the staging writer has published everything queued (failures reported after a reply)."""
    for _ in range(500):
        if not writer.backlog:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)  # the batch in flight


def start_rig(
    host: EngineHost,
    model_dir: Path,
    *,
    ack: AckPolicy = AckPolicy.STAGED,
    chat_template: str | None = None,
    publish_to: EventSink | None = None,
    **config: Any,
) -> Rig:
    """A worker serving on a free loopback port, its app's lifespan starting and draining it.

    Its events are recorded, and also published to ``publish_to`` (a Kafka sink) if given.
    """

    async def start() -> Rig:
        recorder = RecordingLLM(host.engine.llm)
        data_plane, driver_sink = MemoryDataPlane(), RecordingSink()
        worker_sink = RecordingSink() if publish_to is None else TeeSink(publish_to)
        settings = WorkerConfig(
            model_dir=model_dir,
            worker_id="w-test",
            ack_policy=ack,
            port=0,
            served_model_name="tiny",
            chat_template=chat_template,
            **config,
        )
        worker = build_worker(settings, host.engine, data_plane, worker_sink, llm=recorder)
        server = WorkerServer(build_app(worker, settings), host="127.0.0.1", port=0, graceful_timeout_s=10)
        await server.start()
        return Rig(
            host, recorder, server, data_plane, worker_sink, driver_sink, RolloutClient(driver_sink), worker
        )

    return host.run(start())


def token_keys(value: Any) -> set[str]:
    """Every key at any depth of a JSON value that carries tokens (null values do not count)."""
    if isinstance(value, dict):
        found = {k for k, v in value.items() if k in TOKEN_FIELDS and v is not None}
        for item in value.values():
            found |= token_keys(item)
        return found
    if isinstance(value, list):
        return set().union(*(token_keys(item) for item in value)) if value else set()
    return set()


def assert_sample_is_what_the_engine_saw(
    sample: TrainingSample, calls: Sequence[tuple[EngineCall, int]]
) -> None:
    """Each call's prompt is exactly the sample's ids before its generation, which follows it.

    ``calls`` are the engine requests of the sample's chain with the choice each took.
    """
    mask_ones = 0
    for call, index in calls:
        n, gen = len(call.prompt_ids), call.choices[index]
        assert sample.token_ids[:n] == call.prompt_ids
        assert sample.token_ids[n : n + len(gen.token_ids)] == gen.token_ids
        assert sample.logprobs[n : n + len(gen.token_ids)] == pytest.approx(gen.logprobs, abs=1e-7)
        assert sample.token_mask[n : n + len(gen.token_ids)] == [1.0] * len(gen.token_ids)
        mask_ones += len(gen.token_ids)
    last, index = calls[-1]
    assert sample.token_ids == last.prompt_ids + last.choices[index].token_ids
    assert sum(sample.token_mask) == mask_ones


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


def assert_matches_hf(
    oracle: HFOracle, model_dir: Path, sample: TrainingSample, *, greedy: bool = True
) -> None:
    """Logprobs are the HF log-softmax at every generated position, and greedy ids its argmax
    (``greedy=False``: sampled at temperature 1, untruncated, so the log-softmax is the
    distribution that sampled)."""
    log_probs = oracle.log_softmax(model_dir, sample.token_ids)
    positions = [i for i, m in enumerate(sample.token_mask) if m == 1.0]
    assert positions and positions[0] > 0
    for i in positions:
        if greedy:
            assert int(log_probs[i - 1].argmax()) == sample.token_ids[i], f"position {i}"
        assert abs(float(log_probs[i - 1, sample.token_ids[i]]) - sample.logprobs[i]) <= LOGPROB_TOL, i
