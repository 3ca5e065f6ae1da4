"""The Megatron adapter end to end, on in-memory ports.

A stand-in dynamic engine is built from megatron-core 0.19.2's real request classes
(``DynamicInferenceRequest``, ``DynamicInferenceRequestRecord``, ``SamplingParams``):
requests are added, stepped with continuous batching (one token per active request per
step, logits from a tiny Hugging Face causal LM), stamped with ``policy_epoch`` exactly as
the real engine stamps them, checkpointed on eviction with the real ``checkpoint()``, and
finished through ``merge()``. It calls the two hooks where Megatron-LM main calls them:
``prompt_preparer`` when a submission is scheduled, ``payload_stager`` when a request
finishes — both inside ``step()``.

The data plane and the event sink are wrapped so that any call made inside a step
raises and is recorded. "Inside" is tracked two ways: directly (the engine thread while
``step()`` runs) and causally, through a context variable set during the step, which a
coroutine scheduled onto the capture loop from inside the step inherits. The background
writer's own calls run concurrently with steps by design and are not flagged. A control
test shows the guard does catch an upstream-style inline write.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import copy
import inspect
import itertools
import logging
import math
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from megatron.core.inference import inference_request
from megatron.core.inference import sampling_params as sampling

from pipeline.models.tiny import make_tiny_model, read_manifest
from stages.capture.cache import ChainCache
from stages.capture.core import AckPolicy, CaptureCore
from stages.capture.megatron.install import MISSING_HOOKS, HooksUnavailable, install_capture_hooks
from stages.capture.megatron.preparer import TEMPLATE_PREFIX_FIELD, MegatronPromptPreparer
from stages.capture.megatron.registry import PreparedCalls
from stages.capture.megatron.stager import FAILURE_FIELD, EpochSpanPolicy, MegatronPayloadStager, StageResult
from stages.capture.resolve import PrefixResolver
from stages.capture.writer import StagingWriter
from stages.client import RolloutClient
from stages.finalize.stage import FinalizerStage
from stages.ledger.stage import LedgerConfig, LedgerStage
from stages.memory import MemoryDataPlane, RecordingSink
from stages.ports import Consumed
from topics.events import envelope
from topics.records import (
    EXTRAS_WEIGHT_SPANS,
    CommitCoords,
    FinalizedEvent,
    Record,
    RolloutReceipt,
    StagedEvent,
)
from topics.sampling import EXTRAS_SAMPLING
from topics.wire import COORDS_FIELD

DynamicInferenceRequest = inference_request.DynamicInferenceRequest
DynamicInferenceRequestRecord = inference_request.DynamicInferenceRequestRecord
Status = inference_request.Status
SamplingParams = sampling.SamplingParams

IN_STEP: contextvars.ContextVar[bool] = contextvars.ContextVar("in_step", default=False)
USER_TURNS = ("Add {n} and 3.", "And {n} + 4?", "Now multiply them.")


# ------------------------------------------------------------------------- guard


class StepViolation(AssertionError):
    """A data-plane or broker call made from inside an engine step."""


class Guarded:
    """Wraps a port; every coroutine method refuses to run from inside a step."""

    def __init__(self, inner: Any, violations: list[str]) -> None:
        self.inner = inner
        self.violations = violations
        self.engine: StandInEngine | None = None

    def _check(self, name: str) -> None:
        engine = self.engine
        direct = engine is not None and engine.in_step and threading.get_ident() == engine.step_thread
        if IN_STEP.get() or direct:
            self.violations.append(name)
            raise StepViolation(f"{type(self.inner).__name__}.{name} called inside an engine step")

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        def guarded(*args: Any, **kwargs: Any) -> Awaitable[Any]:
            self._check(name)  # in the caller's thread and context
            return self._run(name, attr(*args, **kwargs))

        return guarded

    async def _run(self, name: str, coro: Awaitable[Any]) -> Any:
        self._check(name)  # in the context of the task that runs it
        return await coro


# ---------------------------------------------------------------- stand-in engine


@dataclass
class OffloadedPayload:
    """The shape of Megatron-LM main's ``OffloadedRequestPayload`` (absent in 0.19.2)."""

    prompt_token_ids: list[int] | None
    generated_token_ids: list[int]
    generated_log_probs: list[float] | None
    prompt_log_probs: list[float] | None = None
    routing_indices: Any = None


@dataclass
class FinishedMetadata:
    """The shape of Megatron-LM main's ``FinishedRequestRecord`` (absent in 0.19.2)."""

    policy_epoch: list[tuple[int, int]] | None
    kv_cache_epoch: list[tuple[int, int]] | None
    num_evictions: int


@dataclass
class Served:
    """Engine-side truth of one finished request."""

    prompt_ids: list[int]
    generated_ids: list[int]
    logprobs: list[float]
    token_epochs: list[int]
    admission_epoch: int | None
    evicted: bool


@dataclass
class _Submission:
    request_id: int
    prompt: Any
    sampling_params: Any
    offload_params: dict[str, Any] | None
    reply: concurrent.futures.Future[dict[str, Any]]


@dataclass
class _Active:
    record: Any
    offload_params: Mapping[str, Any] | None
    reply: concurrent.futures.Future[dict[str, Any]]
    token_epochs: list[int] = field(default_factory=list)
    admission_epoch: int | None = None
    evicted: bool = False


class StandInEngine:
    """A dynamic-batching engine over Megatron's real request classes.

    ``payload_form`` picks what the stager receives: ``"main"`` (Megatron-LM main's
    payload + finished metadata shapes) or ``"record"`` (0.19.2's request record itself).
    """

    def __init__(
        self,
        models: Mapping[int, Any],
        *,
        termination_id: int,
        epoch: int | None = 0,
        payload_form: str = "main",
        max_batch: int = 8,
        refit_at_token: int | None = None,
        evict_at_token: int | None = None,
        detokenize: Callable[[list[int]], str] = str,
    ) -> None:
        self.prompt_preparer: Any = None  # the hook attributes of Megatron-LM main
        self.payload_stager: Any = None
        self.models = models
        self.termination_id = termination_id
        self.epoch = epoch
        self.payload_form = payload_form
        self.max_batch = max_batch
        self.refit_at_token = refit_at_token
        self.evict_at_token = evict_at_token
        self.detokenize = detokenize
        self.in_step = False
        self.step_thread: int | None = None
        self.steps = 0
        self.served: dict[str, Served] = {}
        self._inbox: deque[_Submission] = deque()
        self._active: dict[int, _Active] = {}
        self._ids = itertools.count(1)
        self._pending_epoch: int | None = None
        self._lock = threading.Lock()

    # -- thread-safe entry points
    def submit(
        self, prompt: Any, offload_params: dict[str, Any] | None, *, max_tokens: int = 8
    ) -> concurrent.futures.Future[dict[str, Any]]:
        params = SamplingParams(
            temperature=1.0,
            return_log_probs=True,
            skip_prompt_log_probs=True,
            num_tokens_to_generate=max_tokens,
            termination_id=self.termination_id,
        )
        reply: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        with self._lock:
            self._inbox.append(_Submission(next(self._ids), prompt, params, offload_params, reply))
        return reply

    def set_generation_epoch(self, epoch: int) -> None:
        """Like the SET_GENERATION_EPOCH control message: applied at the next step."""
        with self._lock:
            self._pending_epoch = epoch

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._active or self._pending_epoch is not None)

    # -- the step
    def step(self) -> None:
        token = IN_STEP.set(True)
        self.in_step, self.step_thread = True, threading.get_ident()
        try:
            self._schedule()
            self._forward()
            self.steps += 1
        finally:
            self.in_step = False
            IN_STEP.reset(token)

    def _schedule(self) -> None:
        with self._lock:
            submissions = list(self._inbox)
            self._inbox.clear()
            new_epoch, self._pending_epoch = self._pending_epoch, None
        for sub in submissions:
            prompt, params = sub.prompt, sub.offload_params
            if self.prompt_preparer is not None:  # on rank 0, before add_request
                prepared = self.prompt_preparer.prepare_prompt(prompt, offload_params=params)
                prompt, params = prepared.prompt, prepared.offload_params
            self._add_request(sub.request_id, list(prompt), sub.sampling_params, params, sub.reply)
        if self.refit_at_token is not None and any(
            _generated(a.record) == self.refit_at_token for a in self._active.values()
        ):
            new_epoch, self.refit_at_token = (self.epoch or 0) + 1, None
        if new_epoch is not None:
            self._stamp(new_epoch)

    def _add_request(
        self,
        request_id: int,
        prompt_ids: list[int],
        sampling_params: Any,
        offload_params: Mapping[str, Any] | None,
        reply: concurrent.futures.Future[dict[str, Any]],
    ) -> None:
        request = DynamicInferenceRequest(
            request_id=request_id,
            prompt_tokens=torch.tensor(prompt_ids, dtype=torch.int64),
            sampling_params=sampling_params,
        )
        record = DynamicInferenceRequestRecord.from_request(request)
        request.add_event_add_engine()
        if self.epoch is not None:  # as DynamicInferenceEngine._add_request stamps it
            request.policy_epoch = [(0, self.epoch)]
            request.kv_cache_epoch = [(0, self.epoch)]
        request.status = Status.ACTIVE_AND_GENERATING_TOKENS
        self._active[request_id] = _Active(record, offload_params, reply, admission_epoch=self.epoch)

    def _stamp(self, epoch: int) -> None:
        """As DynamicInferenceEngine.schedule_requests stamps a new generation epoch."""
        self.epoch = epoch
        for active in self._active.values():
            request = active.record[-1]
            total = len(request.prompt_tokens) + len(request.generated_tokens)
            if total > 0:
                boundary = (total - 1, epoch)
                if request.policy_epoch is None:
                    request.policy_epoch = [(0, epoch)]
                else:
                    request.policy_epoch.append(boundary)

    def _forward(self) -> None:
        model = self.models[self.epoch or 0]
        for request_id in list(self._active)[: self.max_batch]:
            active = self._active[request_id]
            request = active.record[-1]
            sequence = torch.cat(
                (request.prompt_tokens, torch.tensor(request.generated_tokens, dtype=torch.int64))
            )
            with torch.no_grad():
                logits = model(sequence[None]).logits[0, -1].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            token = int(torch.argmax(logprobs))
            request.generated_tokens.append(token)
            if not request.generated_log_probs:
                request.generated_log_probs = []
            request.generated_log_probs.append(float(logprobs[token]))
            active.token_epochs.append(self.epoch or 0)
            budget = active.record[0].sampling_params.num_tokens_to_generate
            done = token == self.termination_id or _generated(active.record) >= budget
            if done:
                self._finish(request_id, active)
            elif self.evict_at_token is not None and _generated(active.record) == self.evict_at_token:
                self.evict_at_token = None
                active.record.checkpoint()  # the real eviction checkpoint: prompt += generated
                active.record[-1].add_event_evict()
                active.evicted = True

    def _finish(self, request_id: int, active: _Active) -> None:
        del self._active[request_id]
        active.record[-1].status = Status.COMPLETED
        active.record[-1].add_event_finish()
        merged = active.record.merge()
        prompt_ids = merged.prompt_tokens.tolist()
        uid = f"resp-{request_id}"
        self.served[uid] = Served(
            prompt_ids,
            list(merged.generated_tokens),
            list(merged.generated_log_probs),
            list(active.token_epochs),
            active.admission_epoch,
            active.evicted,
        )
        text = self.detokenize(list(merged.generated_tokens))
        reply: dict[str, Any] = {"uid": uid, "text": text, "generated_tokens": list(merged.generated_tokens)}
        if self.payload_stager is not None:
            if self.payload_form == "main":
                payload: Any = OffloadedPayload(
                    prompt_ids, list(merged.generated_tokens), list(merged.generated_log_probs)
                )
                metadata: Any = FinishedMetadata(
                    None if merged.policy_epoch is None else [tuple(b) for b in merged.policy_epoch],
                    None if merged.kv_cache_epoch is None else [tuple(b) for b in merged.kv_cache_epoch],
                    int(active.evicted),
                )
            else:
                payload, metadata = active.record, None
            result = self.payload_stager.stage(
                uid, payload, finished_metadata=metadata, offload_params=active.offload_params
            )
            if result is not None:  # payload offloaded: no token ids in the reply
                reply = {"uid": uid, "text": text, **result.response_metadata}
        reply["served_uid"] = uid
        active.reply.set_result(reply)


def _generated(record: Any) -> int:
    return sum(len(request.generated_tokens) for request in record.requests)


class EngineThread:
    """Steps the engine on its own thread whenever it has work (as a serving loop does)."""

    def __init__(self, engine: StandInEngine) -> None:
        self.engine = engine
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def __enter__(self) -> EngineThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self.engine.has_work():
                    self.engine.step()
                else:
                    self._stop.wait(0.001)
        except BaseException as exc:  # surfaced by the test
            self.error = exc
            raise


async def pump_inline(engine: StandInEngine, stop: asyncio.Event) -> None:
    """Steps the engine on the capture loop's own thread: the loop is frozen during each step,
    so a hook that waited on it would deadlock."""
    while not stop.is_set():
        if engine.has_work():
            engine.step()
            await asyncio.sleep(0)
        else:
            await asyncio.sleep(0.001)


# ------------------------------------------------------------------------ worker


class Worker:
    """Capture core + hooks on guarded in-memory ports; the capture loop is the running loop."""

    def __init__(
        self,
        *,
        eos_token_ids: list[int],
        span_policy: EpochSpanPolicy = EpochSpanPolicy.ALLOW,
        data_plane: MemoryDataPlane | None = None,
    ) -> None:
        self.violations: list[str] = []
        self.data_plane: MemoryDataPlane = data_plane or MemoryDataPlane()
        self.events = RecordingSink()
        self.guarded_plane = Guarded(self.data_plane, self.violations)
        self.guarded_sink = Guarded(self.events, self.violations)
        self.cache = ChainCache()
        self.writer = StagingWriter(self.guarded_plane, self.guarded_sink, worker_id="w", batch_delay_s=0.0)
        self.core = CaptureCore(
            PrefixResolver(self.guarded_plane, self.cache, wait_s=2.0, poll_s=0.005),
            self.writer,
            self.cache,
            ack_policy=AckPolicy.ENQUEUED,
        )
        self.registry = PreparedCalls()
        self.preparer = MegatronPromptPreparer(self.core, self.registry, eos_token_ids=eos_token_ids)
        self.stager = MegatronPayloadStager(self.core, self.registry, span_policy=span_policy)
        self.client = RolloutClient(self.guarded_sink)

    def attach(self, engine: StandInEngine) -> None:
        self.guarded_plane.engine = self.guarded_sink.engine = engine
        assert install_capture_hooks(engine, self.preparer, self.stager)

    def start(self) -> None:
        self.preparer.loop = asyncio.get_running_loop()
        self.writer.start()
        self.stager.start()

    async def stop(self) -> None:
        await self.stager.drain()
        await self.stager.stop()
        await self.writer.stop()


@dataclass
class TinyLM:
    tokenizer: Any
    models: dict[int, Any]
    eos: int  # <|im_end|>: ends every chat turn, and generation

    def detokenize(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False
        )
        return [int(t) for t in ids]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinyLM]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("megatron") / "model", seed=0, vocab_size=512)
    manifest = read_manifest(Path(model_dir))
    assert manifest is not None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    policy = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    refit = copy.deepcopy(policy)  # the "trained" weights a refit loads
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in refit.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    yield TinyLM(tokenizer, {0: policy, 1: refit}, manifest["token_ids"]["<|im_end|>"])
    torch.set_num_threads(threads)


Submit = Callable[[list[int], dict[str, Any]], Awaitable[dict[str, Any]]]


def submitter(engine: StandInEngine) -> Submit:
    async def submit(prompt: list[int], params: dict[str, Any]) -> dict[str, Any]:
        return await asyncio.wrap_future(engine.submit(prompt, params))

    return submit


async def rollout(
    worker: Worker, lm: TinyLM, submit: Submit, rollout_id: str, n: int = 2
) -> list[dict[str, Any]]:
    """Three chat turns; each continuation is spliced onto the exact ids of the previous call."""
    client = worker.client
    turns = [text.format(n=n) for text in USER_TURNS]
    messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": turns[0]}]
    coords: CommitCoords | None = None
    replies = []
    for turn in range(len(turns)):
        admission = client.admit(rollout_id, coords, group_id="g")
        await client.publish_admission(admission)
        await worker.preparer.prefetch(admission)  # when the request arrives, before submission
        params = RolloutClient.request_body({}, admission)
        if coords is not None:
            params[TEMPLATE_PREFIX_FIELD] = lm.render(messages[:-1], generation_prompt=False)
        reply = await submit(lm.render(messages, generation_prompt=True), params)
        replies.append(reply)
        coords = RolloutClient.coords_from_reply(reply)
        assert coords is not None and "generated_tokens" not in reply
        messages.append({"role": "assistant", "content": reply["text"]})
        if turn + 1 < len(turns):
            messages.append({"role": "user", "content": turns[turn + 1]})
    await client.seal(rollout_id, group_id="g", reward=1.0)
    return replies


async def finalize(worker: Worker) -> list[FinalizedEvent]:
    """Ledger, then finalizer, on everything the driver and the worker published."""
    events: list[Record] = [event.payload for event in worker.events.events]
    ledger_out = RecordingSink()
    ledger = LedgerStage(ledger_out, LedgerConfig())
    await ledger.handle([Consumed("in", 0, i, envelope(e)) for i, e in enumerate(events)])
    await ledger.tick(math.inf)  # the log is over (its events all stamped 0): close what is left
    receipts = ledger_out.payloads(RolloutReceipt)
    final_out = RecordingSink()
    finalizer = FinalizerStage(worker.data_plane, final_out)
    await finalizer.handle([Consumed("com", 0, i, envelope(r)) for i, r in enumerate(receipts)])
    return [e for e in final_out.payloads(FinalizedEvent) if isinstance(e, FinalizedEvent)]


def expected_sample(engine: StandInEngine, replies: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """What the sample must hold, from the engine's own record of each call."""
    ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    for reply in replies:
        served = engine.served[reply["served_uid"]]
        carry = served.prompt_ids[len(ids) :]
        assert served.prompt_ids[: len(ids)] == ids, "the engine must see the exact earlier ids"
        ids += carry + served.generated_ids
        logprobs += [0.0] * len(carry) + served.logprobs
        assert served.admission_epoch is not None
        versions += [served.admission_epoch] * len(carry) + served.token_epochs
    return {"token_ids": ids, "logprobs": logprobs, "weight_versions": versions}


def rows_with_spans(worker: Worker) -> list[Any]:
    return [row for row in worker.data_plane.calls.values() if EXTRAS_WEIGHT_SPANS in (row.extras or {})]


def make_engine(lm: TinyLM, *, epoch: int = 0, **options: Any) -> StandInEngine:
    """Policy weights at ``epoch``, the refit's at ``epoch + 1``."""
    models = {epoch: lm.models[0], epoch + 1: lm.models[1]}
    return StandInEngine(models, termination_id=lm.eos, epoch=epoch, detokenize=lm.detokenize, **options)


def check_samples(
    worker: Worker, engine: StandInEngine, finalized: list[FinalizedEvent], all_replies: dict[str, Any]
) -> None:
    assert sorted(e.rollout_id for e in finalized) == sorted(all_replies)
    assert all(e.status == "accepted" for e in finalized), [e.rejection_reason for e in finalized]
    for rollout_id, replies in all_replies.items():
        sample = worker.data_plane.samples[rollout_id]
        want = expected_sample(engine, replies)
        assert sample.token_ids == want["token_ids"]
        assert sample.logprobs == want["logprobs"]
        assert sample.weight_versions == want["weight_versions"]
        assert int(sum(sample.token_mask)) == sum(
            len(engine.served[r["served_uid"]].generated_ids) for r in replies
        )


# ------------------------------------------------------------------------- tests


def test_three_turn_rollouts_on_an_engine_thread_finalize_to_engine_tokens(tiny: TinyLM) -> None:
    """Four concurrent rollouts, continuous batching, a refit mid-call and an eviction."""

    async def go() -> None:
        worker = Worker(eos_token_ids=[tiny.eos])
        engine = make_engine(tiny, refit_at_token=3, evict_at_token=5)
        worker.attach(engine)
        worker.start()
        with EngineThread(engine) as runner:
            results = await asyncio.gather(
                *(rollout(worker, tiny, submitter(engine), f"r{i}", n=i) for i in range(4))
            )
        assert runner.error is None
        await worker.stop()
        assert any(s.evicted for s in engine.served.values())
        assert any(len(set(s.token_epochs)) > 1 for s in engine.served.values()), (
            "no call straddled the refit"
        )
        assert rows_with_spans(worker), "the refit must reach a row's extras"
        check_samples(
            worker, engine, await finalize(worker), dict(zip(["r0", "r1", "r2", "r3"], results, strict=True))
        )
        staged = [e.coords for e in worker.events.payloads(StagedEvent) if isinstance(e, StagedEvent)]
        assert len(staged) == 12 and all(c.disposition == "staged" for c in staged)
        assert worker.preparer.stats.spliced + worker.preparer.stats.exact == 8
        assert worker.violations == []
        assert worker.stager.stats.superseded == 0 and worker.stager.stats.errors == 0
        assert len(worker.registry) == 0

    asyncio.run(go())


def test_hooks_complete_while_the_capture_loop_is_frozen(tiny: TinyLM) -> None:
    """Steps run on the capture loop's own thread, so nothing in a hook can wait on that loop;
    the stager gets 0.19.2's ``DynamicInferenceRequestRecord`` itself."""

    async def go() -> None:
        worker = Worker(eos_token_ids=[tiny.eos])
        engine = make_engine(tiny, payload_form="record", refit_at_token=2)
        worker.attach(engine)
        worker.start()
        stop = asyncio.Event()
        pump = asyncio.create_task(pump_inline(engine, stop))
        results = await asyncio.gather(
            *(rollout(worker, tiny, submitter(engine), f"q{i}", n=10 + i) for i in range(2))
        )
        stop.set()
        await pump
        await worker.stop()
        assert rows_with_spans(worker)
        check_samples(worker, engine, await finalize(worker), {f"q{i}": r for i, r in enumerate(results)})
        assert worker.violations == [] and worker.stager.stats.superseded == 0

    asyncio.run(go())


def test_guard_catches_a_write_made_from_inside_the_step(tiny: TinyLM) -> None:
    """Control: a stager that writes the row from the step and waits for it, as upstream
    capture does, is caught even though the write itself runs on the capture loop."""

    class InlineStager:
        def __init__(self, worker: Worker, loop: asyncio.AbstractEventLoop) -> None:
            self.worker, self.loop, self.caught = worker, loop, 0

        def stage(self, uid: Any, payload: Any, *, finished_metadata: Any, offload_params: Any) -> None:
            async def write() -> None:
                await self.worker.guarded_plane.put_calls([])

            try:
                asyncio.run_coroutine_threadsafe(write(), self.loop).result(timeout=5)
            except StepViolation:
                self.caught += 1

    async def go() -> None:
        worker = Worker(eos_token_ids=[tiny.eos])
        engine = make_engine(tiny)
        worker.guarded_plane.engine = engine
        stager = InlineStager(worker, asyncio.get_running_loop())
        engine.payload_stager = stager
        with EngineThread(engine) as runner:
            await asyncio.wait_for(asyncio.wrap_future(engine.submit([1, 300, 301], None, max_tokens=2)), 30)
        assert runner.error is None
        assert worker.violations == ["put_calls"] and stager.caught == 1

    asyncio.run(go())


def test_reject_policy_fails_a_call_that_straddles_a_refit(tiny: TinyLM) -> None:
    async def go() -> None:
        worker = Worker(eos_token_ids=[tiny.eos], span_policy=EpochSpanPolicy.REJECT)
        engine = make_engine(tiny, epoch=2, refit_at_token=2)
        worker.attach(engine)
        worker.start()
        admission = worker.client.admit("r1")
        await worker.preparer.prefetch(admission)
        stop = asyncio.Event()
        pump = asyncio.create_task(pump_inline(engine, stop))
        prompt = tiny.render([{"role": "user", "content": "Add 2 and 3."}], generation_prompt=True)
        reply = await asyncio.wrap_future(engine.submit(prompt, RolloutClient.request_body({}, admission)))
        stop.set()
        await pump
        await worker.stop()
        assert engine.served[reply["served_uid"]].token_epochs[:3] == [2, 2, 3]
        coords = RolloutClient.coords_from_reply(reply)
        assert coords is not None and coords.disposition == "capture_failed"
        assert coords.failure_reason == "epoch_span_rejected" and coords.weight_version == 2
        assert reply[FAILURE_FIELD]["code"] == "epoch_span_rejected"
        staged = worker.events.payloads(StagedEvent)[-1]
        assert isinstance(staged, StagedEvent) and staged.coords == coords.call_coords()
        assert worker.data_plane.calls == {}

    asyncio.run(go())


def test_unfinished_prefetch_serves_the_plain_prompt_and_fails_prefix_unavailable(tiny: TinyLM) -> None:
    class GatedPlane(MemoryDataPlane):
        def __init__(self) -> None:
            super().__init__()
            self.gate = asyncio.Event()

        async def get_calls(self, keys: Any) -> Any:
            await self.gate.wait()
            return await super().get_calls(keys)

    async def go() -> None:
        plane = GatedPlane()
        worker = Worker(eos_token_ids=[tiny.eos], data_plane=plane)
        engine = make_engine(tiny)
        worker.attach(engine)
        worker.start()
        stop = asyncio.Event()
        pump = asyncio.create_task(pump_inline(engine, stop))
        messages = [{"role": "user", "content": "Add 2 and 3."}]
        first = worker.client.admit("r1")
        await worker.preparer.prefetch(first)
        reply = await asyncio.wrap_future(
            engine.submit(
                tiny.render(messages, generation_prompt=True), RolloutClient.request_body({}, first)
            )
        )
        parent = RolloutClient.coords_from_reply(reply)
        assert parent is not None and parent.disposition == "staged"
        await worker.stager.drain()
        worker.cache.discard(parent.staging_key)  # the child must go to the (stalled) data plane
        child = worker.client.admit("r1", parent)
        prefetch = asyncio.create_task(worker.preparer.prefetch(child))
        await asyncio.sleep(0.01)
        assert not prefetch.done()
        messages += [{"role": "assistant", "content": "5"}, {"role": "user", "content": "And 4 + 4?"}]
        plain = tiny.render(messages, generation_prompt=True)
        params = RolloutClient.request_body({}, child)
        params[TEMPLATE_PREFIX_FIELD] = tiny.render(messages[:-1], generation_prompt=False)
        reply = await asyncio.wrap_future(engine.submit(plain, params))
        coords = RolloutClient.coords_from_reply(reply)
        assert coords is not None and coords.failure_reason == "prefix_unavailable"
        assert engine.served[reply["served_uid"]].prompt_ids == plain  # served, from the plain prompt
        plane.gate.set()
        late = await prefetch
        assert late.failure is None  # resolved after admission, and dropped
        stop.set()
        await pump
        await worker.stop()
        assert len(worker.registry) == 0 and worker.violations == []

    asyncio.run(go())


# ------------------------------------------------------- payloads, traffic, install


def _payload(**changes: Any) -> OffloadedPayload:
    fields: dict[str, Any] = {
        "prompt_token_ids": [5, 6, 7],
        "generated_token_ids": [8, 9],
        "generated_log_probs": [-0.5, -0.25],
    }
    fields.update(changes)
    return OffloadedPayload(**fields)


GOOD_EPOCH = FinishedMetadata([(0, 3)], [(0, 3)], 0)
BAD_PAYLOADS: dict[str, tuple[OffloadedPayload, FinishedMetadata | None]] = {
    "invalid_ids": (_payload(generated_token_ids=[8.0, 9]), GOOD_EPOCH),
    "invalid_ids/bool": (_payload(generated_token_ids=[True, 9]), GOOD_EPOCH),
    "invalid_ids/numpy_float": (_payload(prompt_token_ids=[5, np.float64(6.0), 7]), GOOD_EPOCH),
    "invalid_logprobs": (_payload(generated_log_probs=[float("nan"), -0.25]), GOOD_EPOCH),
    "length_mismatch": (_payload(generated_log_probs=[-0.5]), GOOD_EPOCH),
    "missing_policy_epoch": (_payload(), FinishedMetadata(None, None, 0)),
    "malformed_policy_epoch": (_payload(), FinishedMetadata([(0, 1.5)], None, 0)),
    "missing_logprobs": (_payload(generated_log_probs=None), GOOD_EPOCH),
    "empty_generation": (_payload(generated_token_ids=[], generated_log_probs=[]), GOOD_EPOCH),
}


@pytest.mark.parametrize("case", sorted(BAD_PAYLOADS))
def test_each_bad_payload_fails_capture_with_its_own_code(case: str) -> None:
    async def go() -> None:
        worker = Worker(eos_token_ids=[2])
        worker.start()
        admission = worker.client.admit("r1")
        payload, metadata = BAD_PAYLOADS[case]
        params = RolloutClient.request_body({}, admission)
        prepared = worker.preparer.prepare_prompt([5, 6, 7], offload_params=params)
        result = worker.stager.stage(
            "u1", payload, finished_metadata=metadata, offload_params=prepared.offload_params
        )
        await worker.stop()
        assert isinstance(result, StageResult)
        assert result.coords.disposition == "capture_failed"
        assert result.coords.failure_reason == "invalid_delta"
        assert result.response_metadata[FAILURE_FIELD] == {
            "code": "invalid_delta",
            "detail": case.split("/")[0],
        }
        assert worker.stager.stats.defects == {case.split("/")[0]: 1}
        event = worker.events.payloads(StagedEvent)[-1]
        assert isinstance(event, StagedEvent) and event.coords == result.coords.call_coords()
        assert worker.data_plane.calls == {}

    asyncio.run(go())


def test_ordinary_traffic_passes_through_untouched() -> None:
    async def go() -> None:
        worker = Worker(eos_token_ids=[2])
        worker.start()
        params = {"other": 1}
        prepared = worker.preparer.prepare_prompt("hello", offload_params=params)
        assert prepared.prompt == "hello" and prepared.offload_params is params
        assert worker.preparer.prepare_prompt([1, 2], offload_params=None) == ([1, 2], None)
        assert (
            worker.stager.stage("u", _payload(), finished_metadata=GOOD_EPOCH, offload_params=params) is None
        )
        assert worker.stager.stage("u", _payload(), finished_metadata=GOOD_EPOCH, offload_params=None) is None
        await worker.stop()
        assert worker.events.events == [] and worker.stager.stats.calls == 0

    asyncio.run(go())


def test_token_in_text_prompt_without_renders_is_a_splice_failure() -> None:
    async def go() -> None:
        worker = Worker(eos_token_ids=[2])
        worker.start()
        root = worker.client.admit("r1")
        params = RolloutClient.request_body({}, root)
        served = worker.preparer.prepare_prompt([5, 6, 7], offload_params=params)
        parent = worker.stager.stage(
            "u1", _payload(), finished_metadata=GOOD_EPOCH, offload_params=served.offload_params
        )
        assert parent is not None and parent.coords.disposition == "staged"
        await worker.stager.drain()
        child = worker.client.admit("r1", parent.coords)
        await worker.preparer.prefetch(child)
        served = worker.preparer.prepare_prompt(
            "a text prompt", offload_params=RolloutClient.request_body({}, child)
        )
        assert served.prompt == "a text prompt"
        payload = _payload(
            prompt_token_ids=[5, 6, 7, 8, 9, 4], generated_token_ids=[3], generated_log_probs=[-1.0]
        )
        result = worker.stager.stage(
            "u2", payload, finished_metadata=GOOD_EPOCH, offload_params=served.offload_params
        )
        await worker.stop()
        assert result is not None and result.coords.failure_reason == "prefix_splice_failed"
        assert COORDS_FIELD in result.response_metadata

    asyncio.run(go())


def test_install_capture_hooks_feature_detects(caplog: pytest.LogCaptureFixture) -> None:
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine

    async def go() -> None:
        worker = Worker(eos_token_ids=[2])
        engine = StandInEngine({}, termination_id=2)
        assert install_capture_hooks(engine, worker.preparer, worker.stager)
        assert engine.prompt_preparer is worker.preparer and engine.payload_stager is worker.stager
        bare = object.__new__(DynamicInferenceEngine)  # 0.19.2: no hook attributes
        with caplog.at_level(logging.WARNING):
            assert not install_capture_hooks(bare, worker.preparer, worker.stager)
        assert MISSING_HOOKS in caplog.text and "PR 7015" in caplog.text
        with pytest.raises(HooksUnavailable, match="PR 7015"):
            install_capture_hooks(bare, worker.preparer, worker.stager, required=True)

    asyncio.run(go())


def test_weight_spans_land_in_row_extras_on_generated_offsets() -> None:
    """A boundary stamped at position p rules from generated offset p + 1 - prompt_len."""

    async def go() -> None:
        worker = Worker(eos_token_ids=[2])
        worker.start()
        params = RolloutClient.request_body({}, worker.client.admit("r1"))
        served = worker.preparer.prepare_prompt([5, 6, 7], offload_params=params)
        payload = _payload(generated_token_ids=[8, 9, 10, 11], generated_log_probs=[-1.0] * 4)
        # prompt of 3: stamped at total-1 when 2 tokens were out, then again (twice) before token 3
        metadata = FinishedMetadata([(0, 3), (4, 4), (5, 5), (5, 6)], None, 0)
        result = worker.stager.stage(
            "u", payload, finished_metadata=metadata, offload_params=served.offload_params
        )
        await worker.stop()
        assert result is not None and result.coords.weight_version == 3
        row = worker.data_plane.calls[result.coords.staging_key]
        assert row.extras == {EXTRAS_WEIGHT_SPANS: [[0, 3], [2, 4], [3, 6]]}
        assert row.weight_version == 3

    asyncio.run(go())


@pytest.mark.parametrize(
    ("options", "recorded"),
    [
        ({"temperature": 0.7, "top_k": 20, "top_p": 0.8}, {"temperature": 0.7, "top_k": 20, "top_p": 0.8}),
        ({"temperature": 1.0, "top_k": 0, "top_p": 0.0}, {}),  # Megatron's neutral: known to be neutral
    ],
)
def test_a_request_s_sampling_params_land_in_row_extras(
    options: dict[str, float], recorded: dict[str, float]
) -> None:
    """Megatron's processed log probs are of its request's temperature, top-k and top-p:
    a 0.19.2 request record carries them, and the row records them (DESIGN §4.7)."""

    async def go() -> None:
        worker = Worker(eos_token_ids=[2])
        worker.start()
        params = RolloutClient.request_body({}, worker.client.admit("r1"))
        served = worker.preparer.prepare_prompt([5, 6, 7], offload_params=params)
        request = DynamicInferenceRequest(
            request_id=1,
            prompt_tokens=torch.tensor([5, 6, 7], dtype=torch.int64),
            sampling_params=SamplingParams(**options, return_log_probs=True),
        )
        record = DynamicInferenceRequestRecord.from_request(request)
        request.generated_tokens = [8, 9]
        request.generated_log_probs = [-0.5, -0.25]
        request.policy_epoch = [(0, 0)]
        result = worker.stager.stage("u", record, offload_params=served.offload_params)
        await worker.stop()
        assert result is not None and FAILURE_FIELD not in result.response_metadata, result
        row = worker.data_plane.calls[result.coords.staging_key]
        assert row.extras is not None and row.extras[EXTRAS_SAMPLING] == recorded

    asyncio.run(go())
