"""Capture around vLLM's serving layers, on a scripted engine client (no vLLM engine).

The capturing engine client wraps vLLM's ``AsyncLLM``; here a scripted stand-in yields
outputs shaped like vLLM's ``RequestOutput``, so streaming, cancellation, engine errors
and refit spans are cheap and exact. The capture core, the scope, the splice and the
reply helpers are the real ones, on in-memory ports; the tokenizer and chat template
are the tiny model's own. The real engine runs the same flows in
tests/integration/test_vllm_worker.py.
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import orjson
import pytest
from vllm.sampling_params import RequestOutputKind, SamplingParams

from pipeline.api.errors import InvalidRequest
from pipeline.api.protocols import PROTOCOLS
from pipeline.cli import build_parser
from pipeline.commands.worker import worker_config
from pipeline.models.tiny import make_tiny_model, read_manifest
from pipeline.worker.options import COMMON, RESPONSES, check_content, check_options, field_names
from pipeline.worker.protocol import capture_admissions
from pipeline.worker.reasoning import tool_parser_for
from pipeline.worker.replies import attach_coords, stream_with_coords
from stages.capture.cache import ChainCache
from stages.capture.chat import ChatRenderer
from stages.capture.core import AckPolicy, CaptureCore
from stages.capture.resolve import PrefixResolver
from stages.capture.vllm.client import (
    SCOPE_KEY,
    CapturingEngineClient,
    InvalidWeightVersion,
    LogprobPath,
    SpanPolicy,
    tag_engine_input,
    weight_spans,
)
from stages.capture.vllm.scope import CaptureScope
from stages.capture.writer import StagingWriter
from stages.client import RolloutClient
from stages.memory import MemoryDataPlane, RecordingSink
from topics.choices import choice_admissions
from topics.failures import WorkerFailure
from topics.records import EXTRAS_WEIGHT_SPANS, CaptureAdmission, CommitCoords, StagedCall, StagedEvent
from topics.sampling import EXTRAS_SAMPLING
from topics.wire import CAPTURE_FIELD, COORDS_FIELD, Dialect

T = TypeVar("T")

USER = [{"role": "user", "content": "Add 2 and 3."}]
IM_END = 2  # the tiny model's end-of-turn id
GEN = [312, 340, 302, IM_END]  # " an" + "swer": its text re-encodes to other ids
LOGPROBS = [-0.5, -0.25, -1.0, -0.125]  # exact in float32, as rows store them
DECOY = 999  # a likelier alternative in every logprob entry; never sampled


# ------------------------------------------------------------ a scripted AsyncLLM


@dataclass
class Logprob:
    logprob: float


@dataclass
class Span:
    version: str
    start: int
    end: int


@dataclass
class ChoiceOutput:
    """One choice of a ``RequestOutput`` (vLLM's ``CompletionOutput``)."""

    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    finish_reason: str | None = None
    weight_versions: list[Span] | None = None


@dataclass
class Output:
    """A ``RequestOutput``: the prompt ids and the choices this step reports."""

    prompt_token_ids: list[int] | None
    outputs: list[ChoiceOutput]


def choice(
    index: int,
    ids: Sequence[int],
    logprobs: Sequence[float],
    finish: str | None = None,
    spans: list[Span] | None = None,
) -> ChoiceOutput:
    """A choice output whose logprob entries hold the sampled token and a decoy alternative."""
    entries = [{DECOY: Logprob(-0.0625), t: Logprob(lp)} for t, lp in zip(ids, logprobs, strict=True)]
    return ChoiceOutput(index, list(ids), entries, finish, spans)


class EngineDied(RuntimeError):
    """What the scripted engine raises mid-stream."""


class FakeEngine:
    """Yields its script per request; ``fail_at``/``hang_at`` raise or block at that step."""

    def __init__(self) -> None:
        self.script: list[Output] = []
        self.fail_at: int | None = None
        self.hang_at: int | None = None
        self.calls: list[tuple[Any, Any, str]] = []
        self.streams: list[weakref.ref[AsyncIterator[Output]]] = []  # weak: vLLM closes an abandoned one
        self.closed = 0
        self.versions: list[str] = []
        self.pauses: list[dict[str, Any]] = []
        self.resumes = 0
        self.model_config = "the engine's own attribute"

    def generate(self, prompt: Any, params: Any, request_id: str, **kwargs: Any) -> AsyncIterator[Output]:
        self.calls.append((prompt, params, request_id))
        stream = self._stream(list(self.script))
        self.streams.append(weakref.ref(stream))
        return stream

    async def _stream(self, script: list[Output]) -> AsyncIterator[Output]:
        try:
            for step, output in enumerate(script):
                await asyncio.sleep(0)
                if step == self.fail_at:
                    raise EngineDied("the engine died")
                if step == self.hang_at:
                    await asyncio.Event().wait()
                yield output
        finally:
            self.closed += 1

    async def update_weight_version(self, version: str) -> None:
        self.versions.append(version)

    async def pause_generation(self, **kwargs: Any) -> None:
        self.pauses.append(kwargs)

    async def resume_generation(self) -> None:
        self.resumes += 1


def sampling(
    kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY, *, n: int = 1, logprobs: int | None = None
) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=8, output_kind=kind, logprobs=logprobs)


# ------------------------------------------------------------------ the rig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


@pytest.fixture(scope="module")
def renderer(model_dir: Path) -> ChatRenderer:
    return ChatRenderer.from_pretrained(model_dir)


@dataclass
class Rig:
    """The capture core wired as ``build_worker`` wires it, around the scripted engine."""

    renderer: ChatRenderer
    span_policy: SpanPolicy = SpanPolicy.RECORD
    weight_version: int = 0
    data_plane: MemoryDataPlane = field(default_factory=MemoryDataPlane)
    sink: RecordingSink = field(default_factory=RecordingSink)
    engine: FakeEngine = field(default_factory=FakeEngine)
    driver: RolloutClient = field(default_factory=lambda: RolloutClient(RecordingSink()))

    def __post_init__(self) -> None:
        cache = ChainCache()
        self.core = CaptureCore(
            PrefixResolver(self.data_plane, cache, wait_s=0.05, poll_s=0.01),
            StagingWriter(self.data_plane, self.sink, worker_id="w"),
            cache,
            ack_policy=AckPolicy.STAGED,
        )
        # The fake engine answers with vLLM-shaped logprob entries: vLLM's path reads them.
        self.client = CapturingEngineClient(
            self.engine,
            weight_version=self.weight_version,
            span_policy=self.span_policy,
            logprob_path=LogprobPath.VLLM,
        )

    async def scope(self, admissions: Sequence[CaptureAdmission], response_id: str = "resp") -> CaptureScope:
        return await CaptureScope.open(
            self.core,
            admissions,
            renderer=self.renderer,
            response_id=response_id,
            counters=self.client.counters,
        )

    def generate(self, scope: CaptureScope, prompt_ids: Sequence[int], params: SamplingParams) -> Any:
        """The engine input vLLM's renderer hands over, tagged with the scope, into the client."""
        prompt: dict[str, Any] = {"prompt_token_ids": list(prompt_ids)}
        tag_engine_input(prompt, scope)
        return self.client.generate(prompt, params, "req")

    async def serve(
        self, scope: CaptureScope, prompt_ids: Sequence[int], params: SamplingParams, script: list[Output]
    ) -> list[Output]:
        self.engine.script = script
        return [output async for output in self.generate(scope, prompt_ids, params)]

    async def first_call(self) -> tuple[list[int], CommitCoords]:
        """A captured root call on the rendered ``USER`` prompt, generating ``GEN``."""
        prompt = self.renderer.render(USER)
        scope = await self.scope([self.driver.admit("r", call_id="c1")])
        await self.serve(scope, prompt, sampling(), [Output(prompt, [choice(0, GEN, LOGPROBS, "stop")])])
        coords = await scope.coords(0)
        assert coords.disposition == "staged"
        return prompt, coords

    def row(self, coords: CommitCoords) -> StagedCall:
        return self.data_plane.calls[coords.staging_key]

    def events(self) -> list[StagedEvent]:
        return [e for e in self.sink.payloads(StagedEvent) if isinstance(e, StagedEvent)]


def run(renderer: ChatRenderer, body: Callable[[Rig], Awaitable[T]], **rig: Any) -> T:
    """Run ``body`` on a fresh rig with its staging writer started, then drain the writer."""

    async def go() -> T:
        r = Rig(renderer, **rig)
        r.core.writer.start()
        try:
            return await body(r)
        finally:
            await r.core.writer.stop()

    return asyncio.run(go())


def failed(coords: CommitCoords, code: WorkerFailure) -> bool:
    return coords.disposition == "capture_failed" and coords.failure_reason == code


# ----------------------------------------------------- the capturing engine client


@pytest.mark.parametrize("kind", [RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE])
def test_captured_call_is_staged_with_the_sampled_logprobs(
    renderer: ChatRenderer, kind: RequestOutputKind
) -> None:
    """Final or cumulative outputs: the last one is the whole generation."""
    prompt = [1, 355, 207]
    final = Output(prompt, [choice(0, GEN, LOGPROBS, "stop")])
    script = (
        [final]
        if kind is RequestOutputKind.FINAL_ONLY
        else [Output(prompt, [choice(0, GEN[:1], LOGPROBS[:1])]), final]
    )

    async def body(rig: Rig) -> None:
        admission = rig.driver.admit("r", call_id="c1")
        scope = await rig.scope([admission], response_id="resp-1")
        params = sampling(kind)
        assert await rig.serve(scope, prompt, params, script) == script  # outputs reach vLLM as they were
        coords = await scope.coords(0)
        assert coords.disposition == "staged" and coords.call_id == "c1" and coords.weight_version == 3
        row = rig.row(coords)
        assert row.token_ids_delta == prompt + GEN
        assert row.logprobs_delta == [0.0] * len(prompt) + LOGPROBS
        assert row.token_mask_delta == [0.0] * len(prompt) + [1.0] * len(GEN)
        assert row.weight_version == 3 and row.extras == {EXTRAS_SAMPLING: {}}  # neutral, and known
        [event] = rig.events()
        # The staged event names vLLM's request id (the reply's id), not the scope's provisional one.
        assert event.coords.disposition == "staged" and event.response_id == "req"
        assert event.coords.staging_key == admission.staging_key
        sent_prompt, sent_params, request_id = rig.engine.calls[0]
        assert SCOPE_KEY not in sent_prompt and request_id == "req"
        assert sent_params.logprobs == 0 and sent_params is not params  # the sampled token's logprob
        assert params.logprobs is None  # the caller's parameters are untouched
        assert sent_params.output_kind is kind and sent_params.max_tokens == 8

    run(renderer, body, weight_version=3)


def test_caller_logprobs_are_passed_as_given(renderer: ChatRenderer) -> None:
    """A caller asking for top-k logprobs gets them; the row keeps the sampled token's own."""

    async def body(rig: Rig) -> None:
        scope = await rig.scope([rig.driver.admit("r")])
        params = sampling(logprobs=2)
        await rig.serve(scope, [1, 2], params, [Output([1, 2], [choice(0, GEN, LOGPROBS, "length")])])
        assert rig.engine.calls[0][1] is params and params.logprobs == 2
        assert rig.row(await scope.coords(0)).logprobs_delta == [0.0, 0.0, *LOGPROBS]

    run(renderer, body)


def test_streamed_deltas_of_two_choices_are_captured_apart(renderer: ChatRenderer) -> None:
    """DELTA outputs of n=2 interleave; each choice is captured the moment it finishes."""

    async def body(rig: Rig) -> None:
        _, parent = await rig.first_call()
        scope = await rig.scope(choice_admissions(rig.driver.admit("r", parent, call_id="c2"), 2))
        tail = [1, 355, 207]
        prompt = scope.prefix_ids + tail
        rig.engine.script = [
            Output(prompt, [choice(0, [300], [-0.5])]),
            Output(None, [choice(1, [400], [-1.5])]),
            Output(None, [choice(0, [301], [-0.25]), choice(1, [401], [-1.25])]),
            Output(None, [choice(1, [IM_END], [-0.125], "stop")]),
            Output(None, [choice(0, [302], [-0.75], "length")]),
        ]
        seen = []
        async for _ in rig.generate(scope, prompt, sampling(RequestOutputKind.DELTA, n=2)):
            seen.append((scope.captured(0), scope.captured(1)))
        assert seen == [(False, False)] * 3 + [(False, True), (True, True)]
        first, second = await scope.coords(0), await scope.coords(1)
        assert (first.call_id, second.call_id) == ("c2.0", "c2.1")
        for coords in (first, second):
            assert coords.disposition == "staged" and coords.parent_call_id == parent.call_id
            assert coords.prev_len == parent.cum_len and coords.mode == "token_in"
        assert rig.row(first).token_ids_delta == [*tail, 300, 301, 302]
        assert rig.row(first).logprobs_delta == [0.0, 0.0, 0.0, -0.5, -0.25, -0.75]
        assert rig.row(second).token_ids_delta == [*tail, 400, 401, IM_END]
        assert rig.row(second).logprobs_delta == [0.0, 0.0, 0.0, -1.5, -1.25, -0.125]

    run(renderer, body)


def test_closing_the_stream_fails_every_unfinished_choice(renderer: ChatRenderer) -> None:
    """The serving layer closes the generator (client gone): client_disconnected, no row."""

    async def body(rig: Rig) -> None:
        scope = await rig.scope(choice_admissions(rig.driver.admit("r", call_id="c1"), 2))
        rig.engine.script = [
            Output([1, 2], [choice(0, [300], [-0.5])]),
            Output(None, [choice(0, [IM_END], [-0.5], "stop"), choice(1, [IM_END], [-0.5], "stop")]),
        ]
        stream = rig.generate(scope, [1, 2], sampling(RequestOutputKind.DELTA, n=2))
        await stream.__anext__()
        await stream.aclose()
        for index in range(2):
            assert failed(await scope.coords(index), WorkerFailure.CLIENT_DISCONNECTED)
        assert rig.client.counters.abandoned_calls == 2 and rig.client.engine_errors == 0
        await asyncio.sleep(0.01)
        assert rig.engine.closed == 1  # vLLM's own generator is finalized, so it aborts the request
        assert rig.data_plane.calls == {}
        assert [e.coords.failure_reason for e in rig.events()] == ["client_disconnected"] * 2

    run(renderer, body)


def test_cancelled_consumer_fails_the_call(renderer: ChatRenderer) -> None:
    """A request task cancelled while the engine is generating: client_disconnected."""

    async def body(rig: Rig) -> None:
        scope = await rig.scope([rig.driver.admit("r")])
        rig.engine.script = [Output([1, 2], [choice(0, [300], [-0.5])])] * 2
        rig.engine.hang_at = 1

        async def consume() -> None:
            async for _ in rig.generate(scope, [1, 2], sampling(RequestOutputKind.DELTA)):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert failed(await scope.coords(0), WorkerFailure.CLIENT_DISCONNECTED)
        assert rig.engine.closed == 1 and rig.client.engine_errors == 0

    run(renderer, body)


def test_engine_error_mid_stream_is_not_served(renderer: ChatRenderer) -> None:
    async def body(rig: Rig) -> None:
        scope = await rig.scope([rig.driver.admit("r")])
        rig.engine.script = [Output([1, 2], [choice(0, [300], [-0.5])])] * 2
        rig.engine.fail_at = 1
        with pytest.raises(EngineDied):
            async for _ in rig.generate(scope, [1, 2], sampling(RequestOutputKind.DELTA)):
                pass
        assert failed(await scope.coords(0), WorkerFailure.NOT_SERVED)
        assert rig.client.engine_errors == 1 and rig.data_plane.calls == {}

    run(renderer, body)


def test_stream_ending_without_a_finish_is_not_served(renderer: ChatRenderer) -> None:
    """An aborted choice (finish_reason "abort") is never captured: not_served when the stream ends."""

    async def body(rig: Rig) -> None:
        scope = await rig.scope([rig.driver.admit("r")])
        script = [Output([1, 2], [choice(0, [300], [-0.5], "abort")])]
        await rig.serve(scope, [1, 2], sampling(), script)
        assert failed(await scope.coords(0), WorkerFailure.NOT_SERVED)
        assert rig.client.engine_errors == 0 and rig.data_plane.calls == {}

    run(renderer, body)


def test_choice_finished_with_an_engine_error_is_not_staged(renderer: ChatRenderer) -> None:
    """vLLM's ``error`` finish (a request-level engine error) is never served, so never staged."""

    async def body(rig: Rig) -> None:
        scope = await rig.scope([rig.driver.admit("r")])
        script = [Output([1, 2], [choice(0, [300, 301], [-0.5, -0.5], "error")])]
        await rig.serve(scope, [1, 2], sampling(), script)
        coords = await scope.coords(0)
        assert rig.data_plane.calls == {}, "a row was staged for a call answered with a 500"
        assert failed(coords, WorkerFailure.NOT_SERVED)

    run(renderer, body)


def test_untagged_requests_pass_through_untouched() -> None:
    engine = FakeEngine()
    engine.script = [Output([1, 2], [choice(0, [300], [-0.5], "stop")])]
    client = CapturingEngineClient(engine, logprob_path=LogprobPath.VLLM)
    params = sampling()
    prompt = {"prompt_token_ids": [1, 2]}
    stream: AsyncIterator[Output] = client.generate(prompt, params, "req")
    assert stream is engine.streams[0]()  # vLLM's own generator, not a wrapper
    assert engine.calls[0] == (prompt, params, "req") and engine.calls[0][1] is params
    assert params.logprobs is None

    async def collect() -> list[Output]:
        return [output async for output in stream]

    assert asyncio.run(collect()) == engine.script
    assert client.generate("a text prompt", params, "req2") is engine.streams[1]()
    assert client.model_config == "the engine's own attribute"  # everything else is delegated


# ------------------------------------------------------------------ refits


STRADDLE = [Span("0", 0, 1), Span("1", 1, 4)]


@pytest.mark.parametrize(
    ("policy", "spans", "code"),
    [
        (SpanPolicy.RECORD, STRADDLE, None),
        (SpanPolicy.REJECT, STRADDLE, WorkerFailure.EPOCH_SPAN_REJECTED),
        (SpanPolicy.RECORD, [Span("default", 0, 4)], WorkerFailure.EPOCH_SPAN_REJECTED),
    ],
)
def test_refit_spans_recorded_or_rejected(
    renderer: ChatRenderer, policy: SpanPolicy, spans: list[Span], code: WorkerFailure | None
) -> None:
    async def body(rig: Rig) -> None:
        scope = await rig.scope([rig.driver.admit("r")])
        await rig.serve(
            scope, [1, 2], sampling(), [Output([1, 2], [choice(0, GEN, LOGPROBS, "stop", spans)])]
        )
        coords = await scope.coords(0)
        if code is not None:
            assert failed(coords, code) and rig.data_plane.calls == {}
            return
        assert coords.disposition == "staged" and coords.weight_version == 0
        assert rig.row(coords).extras == {EXTRAS_SAMPLING: {}, EXTRAS_WEIGHT_SPANS: [[0, 0], [1, 1]]}
        assert rig.client.counters.refit_straddles == 1

    run(renderer, body, span_policy=policy)


def test_weight_spans_rules() -> None:
    assert weight_spans([Span("3", 0, 5)], 3) is None
    assert weight_spans([], 3) is None
    assert weight_spans([Span("4", 0, 5)], 3) == [[0, 4]]  # queued across a refit
    spans = [Span("3", 0, 2), Span("3", 2, 2), Span("4", 2, 4), Span("4", 4, 6)]
    assert weight_spans(spans, 3) == [[0, 3], [2, 4]]
    assert weight_spans([Span("4", 2, 5)], 3) == [[0, 3], [2, 4]]
    with pytest.raises(ValueError, match="not an integer"):
        weight_spans([Span("default", 0, 5)], 0)


def test_weight_version_stamps_calls_entering_after_it(renderer: ChatRenderer) -> None:
    """Only integer versions; a call in flight keeps the version it entered with."""

    async def body(rig: Rig) -> None:
        for bad in ("abc", "-1"):
            with pytest.raises(InvalidWeightVersion):
                await rig.client.update_weight_version(bad)
        assert rig.engine.versions == [] and rig.client.weight_version == 0

        early = await rig.scope([rig.driver.admit("r")])
        rig.engine.script = [
            Output([1, 2], [choice(0, [300], [-0.5])]),
            Output(None, [choice(0, [IM_END], [-0.5], "stop", [Span("0", 0, 1), Span("7", 1, 2)])]),
        ]
        stream = rig.generate(early, [1, 2], sampling(RequestOutputKind.DELTA))
        await stream.__anext__()  # in the engine under version 0
        await rig.client.update_weight_version("7")
        assert rig.engine.versions == ["7"] and rig.client.weight_version == 7
        async for _ in stream:
            pass
        in_flight = await early.coords(0)
        assert in_flight.weight_version == 0
        assert rig.row(in_flight).extras == {EXTRAS_SAMPLING: {}, EXTRAS_WEIGHT_SPANS: [[0, 0], [1, 7]]}

        late = await rig.scope([rig.driver.admit("r")])
        await rig.serve(late, [1, 2], sampling(), [Output([1, 2], [choice(0, GEN, LOGPROBS, "stop")])])
        assert (await late.coords(0)).weight_version == 7

        await rig.client.pause_generation(mode="keep", clear_cache=True)
        assert rig.client.paused and rig.engine.pauses == [{"mode": "keep", "clear_cache": True}]
        await rig.client.resume_generation()
        assert not rig.client.paused and rig.engine.resumes == 1

    run(renderer, body)


# ------------------------------------------------------------------ the prompt


def follow_up(assistant: str = "The answer is 5.") -> list[dict[str, Any]]:
    return [*USER, {"role": "assistant", "content": assistant}, {"role": "user", "content": "Thanks."}]


def test_continuation_is_spliced_onto_the_exact_prefix(renderer: ChatRenderer) -> None:
    async def body(rig: Rig) -> None:
        prompt, parent = await rig.first_call()
        exact = prompt + GEN
        scope = await rig.scope([rig.driver.admit("r", parent)])
        assert scope.prefix_ids == exact
        messages = follow_up()
        full = renderer.render(messages)
        spliced = scope.splice_chat(messages, None, full)
        assert spliced[: len(exact)] == exact
        assert full[: len(exact)] != exact  # the re-render alone loses the sampled ids
        tail = spliced[len(exact) :]
        assert tail and full[-len(tail) :] == tail  # then the template's new turn, as rendered
        assert scope.failure is None
        script = [Output(spliced, [choice(0, [300, IM_END], [-0.5, -0.5], "stop")])]
        await rig.serve(scope, spliced, sampling(), script)
        coords = await scope.coords(0)
        assert coords.disposition == "staged" and coords.prev_len == parent.cum_len
        assert rig.row(coords).token_ids_delta == [*tail, 300, IM_END]

    run(renderer, body)


def test_continuation_without_an_assistant_turn_fails_the_splice(renderer: ChatRenderer) -> None:
    async def body(rig: Rig) -> None:
        _, parent = await rig.first_call()
        scope = await rig.scope([rig.driver.admit("r", parent)])
        messages = [*USER, {"role": "user", "content": "Hello?"}]
        full = renderer.render(messages)
        assert scope.splice_chat(messages, None, full) is full  # served from vLLM's render
        assert scope.failure == WorkerFailure.PREFIX_SPLICE_FAILED
        assert rig.client.counters.splice_failures == 1
        await rig.serve(scope, full, sampling(), [Output(full, [choice(0, GEN, LOGPROBS, "stop")])])
        assert failed(await scope.coords(0), WorkerFailure.PREFIX_SPLICE_FAILED)

    run(renderer, body)


def test_unresolvable_prefix_is_served_from_the_plain_render(renderer: ChatRenderer) -> None:
    """A parent no worker staged: the scope fails with prefix_unavailable after the bounded wait."""

    async def body(rig: Rig) -> None:
        ghost = CaptureAdmission(
            rollout_id="r",
            call_id="c2",
            parent_call_id="ghost",
            mode="token_in",
            prev_len=len(GEN),
            staging_chain=["r/ghost"],
            parent_chain_hash="0" * 64,
            admitted_at=time.time(),
        )
        scope = await rig.scope([ghost])
        assert scope.failure == WorkerFailure.PREFIX_UNAVAILABLE
        messages = follow_up()
        full = renderer.render(messages)
        assert scope.splice_chat(messages, None, full) is full
        await rig.serve(scope, full, sampling(), [Output(full, [choice(0, GEN, LOGPROBS, "stop")])])
        assert failed(await scope.coords(0), WorkerFailure.PREFIX_UNAVAILABLE)
        assert [e.coords.failure_reason for e in rig.events()] == ["prefix_unavailable"]

    run(renderer, body)


def test_completion_prompt_must_start_with_the_prefix(renderer: ChatRenderer) -> None:
    def decode(ids: list[int]) -> str:
        return str(renderer.tokenizer.decode(ids, skip_special_tokens=False))

    async def body(rig: Rig) -> None:
        prompt, parent = await rig.first_call()
        exact = prompt + GEN
        scope = await rig.scope([rig.driver.admit("r", parent)])
        tokens = [*exact, 5, 6]
        assert scope.splice_tokens(tokens, decode, None) is tokens  # ids that start with it: as sent
        text = decode(exact) + " More."
        rendered = renderer.encode(text)
        assert rendered[: len(exact)] != exact  # the tokenizer alone would not reproduce the prefix
        assert scope.splice_tokens(rendered, decode, text) == exact + renderer.encode(" More.")
        assert scope.failure is None
        other = renderer.encode("Unrelated.")
        assert scope.splice_tokens(other, decode, "Unrelated.") is other
        assert scope.failure == WorkerFailure.PREFIX_SPLICE_FAILED
        assert rig.client.counters.splice_failures == 1

    run(renderer, body)


# ------------------------------------------------------------------ options


@pytest.fixture(scope="module")
def known_fields() -> dict[str, frozenset[str]]:
    """The fields vLLM's own request models know, per protocol."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    return {"chat": field_names(ChatCompletionRequest), "responses": field_names(ResponsesRequest)}


@pytest.mark.parametrize(
    ("dialect", "body", "captured", "param", "text"),
    [
        ("chat", {"messages": USER, "frobnicate": 1}, False, "frobnicate", "unknown parameter"),
        ("chat", {"messages": USER, "kv_transfer_params": {}}, False, "kv_transfer_params", "disaggregated"),
        (
            "chat",
            {"messages": USER, "truncate_prompt_tokens": 5},
            True,
            "truncate_prompt_tokens",
            "ng_capture",
        ),
        ("chat", {"messages": USER, "add_generation_prompt": False}, True, "add_generation_prompt", "exact"),
        ("chat", {"messages": USER, "use_beam_search": True}, True, "use_beam_search", "beam search"),
        ("responses", {"input": "hi", "store": True}, False, "store", "store=false"),
        ("responses", {"input": "hi", "truncation": "auto"}, False, "truncation", "never drops"),
        ("responses", {"input": "hi", "previous_response_id": "r"}, False, "previous_response_id", "store"),
    ],
)
def test_refused_options_name_the_field(
    known_fields: dict[str, frozenset[str]],
    dialect: str,
    body: dict[str, Any],
    captured: bool,
    param: str,
    text: str,
) -> None:
    refusals = {**COMMON, **RESPONSES} if dialect == "responses" else COMMON
    with pytest.raises(InvalidRequest) as caught:
        check_options(body, known_fields[dialect], refusals, captured=captured)
    assert caught.value.param == param
    assert caught.value.message.startswith(f"{param}: ") and text in caught.value.message


@pytest.mark.parametrize(
    ("dialect", "body", "captured"),
    [
        ("chat", {"messages": USER, "max_tokens": 5, "temperature": 0.7, "n": 2, "logprobs": True}, True),
        ("chat", {"messages": USER, "truncate_prompt_tokens": 5}, False),  # only captured calls refuse it
        ("chat", {"messages": USER, "kv_transfer_params": None, "add_generation_prompt": True}, True),
        ("chat", {"messages": USER, CAPTURE_FIELD: {"anything": 1}}, True),
        ("responses", {"input": "hi", "store": False, "truncation": "disabled"}, True),
    ],
)
def test_honoured_options_pass(
    known_fields: dict[str, frozenset[str]], dialect: str, body: dict[str, Any], captured: bool
) -> None:
    refusals = {**COMMON, **RESPONSES} if dialect == "responses" else COMMON
    check_options(body, known_fields[dialect], refusals, captured=captured)


IMAGE_IN_CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]},
    ]
}
IMAGE_IN_RESPONSES = {
    "input": [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "What is this?"},
                {"type": "input_image", "image_url": "x"},
            ],
        }
    ]
}
IMAGE_IN_TOOL_RESULT = {
    "messages": [
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": [{"type": "text", "text": "ok"}, {"type": "image", "source": {}}],
                }
            ],
        }
    ]
}


@pytest.mark.parametrize(
    ("body", "dialect", "param"),
    [
        (IMAGE_IN_CHAT, "chat", "messages[1].content[0].type"),
        (IMAGE_IN_RESPONSES, "responses", "input[0].content[1].type"),
        (IMAGE_IN_TOOL_RESULT, "messages", "messages[0].content[0].content[1].type"),
        ({"messages": USER, "system": [{"type": "document"}]}, "messages", "system[0].type"),
    ],
)
def test_non_text_content_is_refused(body: dict[str, Any], dialect: str, param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        check_content(body, PROTOCOLS[dialect])
    assert caught.value.param == param and caught.value.message.startswith(f"{param}: ")


def test_text_content_passes() -> None:
    check_content(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, PROTOCOLS["chat"]
    )
    check_content(
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]},
        PROTOCOLS["responses"],
    )
    tool_result = {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "4"}]}
    check_content({"messages": [{"role": "user", "content": [tool_result]}]}, PROTOCOLS["messages"])


# ------------------------------------------------------------------ ng_capture


def admission_json(call_id: str = "c1", **update: Any) -> dict[str, Any]:
    admission = RolloutClient(RecordingSink()).admit("r", call_id=call_id)
    return {**admission.model_dump(mode="json"), **update}


def test_capture_admissions_per_choice() -> None:
    assert capture_admissions(None, 3) == []
    [one] = capture_admissions(admission_json(), 1)
    assert one.call_id == "c1"
    assert [a.call_id for a in capture_admissions(admission_json(), 3)] == ["c1.0", "c1.1", "c1.2"]
    listed = capture_admissions([admission_json("a"), admission_json("b")], 2)
    assert [a.call_id for a in listed] == ["a", "b"]


@pytest.mark.parametrize(
    ("raw", "n", "param", "text"),
    [
        ([admission_json("a"), admission_json("b")], 3, CAPTURE_FIELD, "2 admissions for n=3"),
        ([admission_json("a"), admission_json("b", prev_len=4)], 2, "ng_capture[1].prev_len", "prev_len"),
        ([admission_json("a"), admission_json("a")], 2, CAPTURE_FIELD, "admitted twice"),
        ({"rollout_id": "r"}, 1, "ng_capture.call_id", "Field required"),
        ([admission_json("a"), {"rollout_id": "r", "call_id": "b"}], 2, "ng_capture[1].prev_len", "required"),
    ],
)
def test_invalid_admissions_name_the_field(raw: Any, n: int, param: str, text: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        capture_admissions(raw, n)
    assert caught.value.param == param and text in caught.value.message


def test_admissions_of_one_request_share_one_prefix() -> None:
    parent = CommitCoords(
        rollout_id="r",
        call_id="p",
        mode="text",
        prev_len=0,
        delta_len=4,
        cum_len=4,
        weight_version=0,
        staging_key="r/p",
        staging_chain=["r/p"],
        chain_hash="a" * 64,
        cumulative_hash="b" * 64,
        digest="c" * 64,
        extras_digest="d" * 64,
        disposition="staged",
    )
    child = RolloutClient(RecordingSink()).admit("r", parent, call_id="b").model_dump(mode="json")
    with pytest.raises(InvalidRequest) as caught:
        capture_admissions([admission_json("a"), child], 2)
    assert caught.value.param == CAPTURE_FIELD and "[1]" in caught.value.message


# ------------------------------------------------------------------ replies


async def captured_scope(rig: Rig, n: int, *, capture: Sequence[int] = ()) -> CaptureScope:
    """A scope of ``n`` choices of call ``c1``, with the choices in ``capture`` captured."""
    admissions = choice_admissions(rig.driver.admit("r", call_id="c1"), n)
    scope = await rig.scope(admissions)
    for index in capture:
        capture_choice(scope, index)
    return scope


def capture_choice(scope: CaptureScope, index: int) -> None:
    scope.capture(index, [1, 2], [300 + index, IM_END], [-0.5, -0.25], weight_version=0)


def sse(data: dict[str, Any], event: str | None = None) -> str:
    """An SSE message with compact JSON, as vLLM writes them."""
    head = "" if event is None else f"event: {event}\n"
    return f"{head}data: {orjson.dumps(data).decode()}\n\n"


def data_of(message: str) -> dict[str, Any]:
    assert message.endswith("\n\n")
    parsed = json.loads(message[message.index("data: ") + len("data: ") :])
    assert isinstance(parsed, dict)
    return parsed


async def listed(events: AsyncIterator[str]) -> list[str]:
    return [event async for event in events]


def chunk(index: int, finish: str | None) -> dict[str, Any]:
    return {"id": "x", "choices": [{"index": index, "delta": {"content": "a"}, "finish_reason": finish}]}


def test_reply_carries_each_choices_coords(renderer: ChatRenderer) -> None:
    async def body(rig: Rig) -> None:
        two = await captured_scope(rig, 2, capture=[0, 1])
        reply: dict[str, Any] = {
            "id": "x",
            "choices": [{"index": 0, "message": {}}, {"index": 1, "message": {}}],
        }
        reply = await attach_coords(reply, PROTOCOLS["chat"], two)
        assert COORDS_FIELD not in reply
        assert [c[COORDS_FIELD]["call_id"] for c in reply["choices"]] == ["c1.0", "c1.1"]
        assert all(c[COORDS_FIELD]["disposition"] == "staged" for c in reply["choices"])

        one = await captured_scope(rig, 1, capture=[0])
        reply = await attach_coords(
            {"id": "y", "choices": [{"index": 0, "text": "a"}]}, PROTOCOLS["completions"], one
        )
        assert reply[COORDS_FIELD] == reply["choices"][0][COORDS_FIELD]
        coords = RolloutClient.coords_from_reply(reply)
        assert coords is not None and coords.call_id == "c1" and coords.disposition == "staged"

        message = await attach_coords({"type": "message", "content": []}, PROTOCOLS["messages"], one)
        assert message[COORDS_FIELD]["call_id"] == "c1"

    run(renderer, body)


def test_chat_stream_puts_coords_on_each_finishing_chunk(renderer: ChatRenderer) -> None:
    async def body(rig: Rig) -> None:
        scope = await captured_scope(rig, 2, capture=[1])

        async def events() -> AsyncIterator[str]:
            yield sse(chunk(0, None))
            yield sse(chunk(1, "stop"))
            capture_choice(scope, 0)  # as the engine client does, before the serving layer replies
            yield sse(chunk(0, "length"))
            yield "data: [DONE]\n\n"

        out = await listed(stream_with_coords(events(), PROTOCOLS["chat"], scope, 0))
        assert out[0] == sse(chunk(0, None)) and out[3] == "data: [DONE]\n\n"
        second, first = data_of(out[1]), data_of(out[2])
        assert second["choices"][0][COORDS_FIELD]["call_id"] == "c1.1" and COORDS_FIELD not in second
        assert first["choices"][0][COORDS_FIELD]["call_id"] == "c1.0" and COORDS_FIELD not in first
        assert all(m.startswith("data: ") and m.endswith("\n\n") for m in out)

        single = await captured_scope(rig, 1, capture=[0])

        async def one() -> AsyncIterator[str]:
            yield sse(chunk(0, "stop"))

        [last] = await listed(stream_with_coords(one(), PROTOCOLS["chat"], single, 0))
        assert data_of(last)[COORDS_FIELD] == data_of(last)["choices"][0][COORDS_FIELD]

    run(renderer, body)


@pytest.mark.parametrize(
    ("dialect", "events", "final", "where"),
    [
        (
            "responses",
            [
                sse({"type": "response.created", "response": {"id": "r1"}}, "response.created"),
                sse({"type": "response.output_text.delta", "delta": "a"}, "response.output_text.delta"),
                sse({"type": "response.completed", "response": {"id": "r1"}}, "response.completed"),
            ],
            2,
            lambda data: data["response"],
        ),
        (
            "messages",
            [
                sse({"type": "message_start", "message": {"id": "m1"}}, "message_start"),
                sse({"type": "content_block_delta", "delta": {"text": "a"}}, "content_block_delta"),
                sse({"type": "message_delta", "delta": {"stop_reason": "end_turn"}}, "message_delta"),
                sse({"type": "message_stop"}, "message_stop"),
            ],
            2,
            lambda data: data,
        ),
    ],
)
def test_final_event_carries_the_coords(
    renderer: ChatRenderer,
    dialect: Dialect,
    events: list[str],
    final: int,
    where: Callable[[dict[str, Any]], dict[str, Any]],
) -> None:
    async def body(rig: Rig) -> None:
        scope = await captured_scope(rig, 1, capture=[0])

        async def stream() -> AsyncIterator[str]:
            for event in events:
                yield event

        out = await listed(stream_with_coords(stream(), PROTOCOLS[dialect], scope, 0))
        assert [m for i, m in enumerate(out) if i != final] == [e for i, e in enumerate(events) if i != final]
        kind = events[final].split("\n", 1)[0]
        assert out[final].startswith(f"{kind}\ndata: ") and out[final].endswith("\n\n")
        data = data_of(out[final])
        assert where(data)[COORDS_FIELD]["call_id"] == "c1"
        assert where(data)[COORDS_FIELD]["disposition"] == "staged"
        assert data_of(out[final - 1]) == data_of(events[final - 1])

    run(renderer, body)


def test_abandoned_or_unfinished_stream_fails_its_calls(renderer: ChatRenderer) -> None:
    async def body(rig: Rig) -> None:
        scope = await captured_scope(rig, 1)

        async def events() -> AsyncIterator[str]:
            yield sse(chunk(0, None))
            yield sse(chunk(0, None))

        stream = cast(AsyncGenerator[str, None], stream_with_coords(events(), PROTOCOLS["chat"], scope, 0))
        await stream.__anext__()
        await stream.aclose()  # the client went away
        assert failed(await scope.coords(0), WorkerFailure.CLIENT_DISCONNECTED)

        unfinished = await captured_scope(rig, 1)
        await listed(stream_with_coords(events(), PROTOCOLS["chat"], unfinished, 0))
        assert failed(await unfinished.coords(0), WorkerFailure.NOT_SERVED)

    run(renderer, body)


async def chat_stream(outputs: AsyncIterator[Output]) -> AsyncIterator[str]:
    """A stand-in for vLLM's chat stream: one chunk per choice output, yielded inside its loop."""
    async for output in outputs:
        for c in output.outputs:
            yield sse(chunk(c.index, c.finish_reason))
    yield "data: [DONE]\n\n"


def test_engine_client_and_stream_compose(renderer: ChatRenderer) -> None:
    """The client captures before the serving layer replies, so the finishing chunk has coords."""

    async def body(rig: Rig) -> None:
        scope = await captured_scope(rig, 1)
        rig.engine.script = [
            Output([1, 2], [choice(0, [300], [-0.5])]),
            Output(None, [choice(0, [IM_END], [-0.5], "stop")]),
        ]
        engine = rig.generate(scope, [1, 2], sampling(RequestOutputKind.DELTA))
        out = await asyncio.wait_for(
            listed(stream_with_coords(chat_stream(engine), PROTOCOLS["chat"], scope, 0)), 5
        )
        coords = data_of(out[1])[COORDS_FIELD]
        assert coords["disposition"] == "staged" and coords["delta_len"] == 4

    run(renderer, body)


def test_aborted_choice_does_not_hang_the_stream(renderer: ChatRenderer) -> None:
    """vLLM streams an ``abort`` finish as a chunk (e.g. pause_generation(mode="abort"))."""

    async def body(rig: Rig) -> None:
        scope = await captured_scope(rig, 1)
        rig.engine.script = [Output([1, 2], [choice(0, [300], [-0.5], "abort")])]
        engine = rig.generate(scope, [1, 2], sampling(RequestOutputKind.DELTA))
        events = stream_with_coords(chat_stream(engine), PROTOCOLS["chat"], scope, 0)
        try:
            out = await asyncio.wait_for(listed(events), 2)
        except TimeoutError:
            pytest.fail("the stream hangs on the aborted choice's finishing chunk")
        assert data_of(out[0])[COORDS_FIELD]["failure_reason"] == "not_served"

    run(renderer, body)


# ------------------------------------------------------------------ the verb and the model


def test_cli_verb_builds_the_worker_config(model_dir: Path, tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "worker",
            "--engine",
            "vllm",
            "--model",
            str(model_dir),
            "--port",
            "0",
            "--ack",
            "enqueued",
            "--bootstrap",
            "127.0.0.1:9092",
            "--dataplane-addresses",
            "dp.json",
            "--worker-id",
            "w7",
            "--max-body-bytes",
            "4096",
            "--span-policy",
            "reject",
        ]
    )
    config = worker_config(args)
    assert (config.port, config.ack_policy, config.worker_id) == (0, AckPolicy.ENQUEUED, "w7")
    assert config.max_body_bytes == 4096 and config.span_policy is SpanPolicy.REJECT
    base = ["worker", "--model", str(model_dir), "--bootstrap", "127.0.0.1:9092"]
    default = worker_config(build_parser().parse_args(base))
    assert default.max_body_bytes == 8 * 2**20
    assert (default.chat_template, default.tool_parser, default.tokenizer_mode) == (None, "auto", "auto")
    assert [tool_parser_for("auto", family) for family in ("chatml", "gptoss", "gpt_oss")] == [
        "hermes",
        "openai",
        "openai",
    ]
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--max-body-bytes", "0"])
    assert config.engine_settings().engine_kwargs()["logprobs_mode"] == "processed_logprobs"
    assert args.dataplane_addresses == Path("dp.json") and callable(args.run)

    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    chosen = worker_config(
        build_parser().parse_args([*base, "--chat-template", str(template), "--tool-call-parser", "none"])
    )
    assert chosen.chat_template == template.read_text() and chosen.tool_parser is None
    other = worker_config(build_parser().parse_args([*base, "--tool-call-parser", "llama3_json"]))
    assert other.tool_parser == "llama3_json"


def test_renderer_knows_every_eos(renderer: ChatRenderer, model_dir: Path) -> None:
    manifest = read_manifest(model_dir)
    assert manifest is not None
    assert renderer.eos_token_ids == frozenset(manifest["eos_token_ids"])
    assert IM_END in renderer.eos_token_ids
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
