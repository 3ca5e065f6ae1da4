"""The vLLM worker's logic and HTTP surface on a scripted engine (no vLLM).

The real engine runs the same flows in tests/integration/test_vllm_worker.py; here a
fake engine makes failure paths (splice, prefix, refit policy, engine errors) cheap
and exact. The tokenizer and chat template are the tiny model's own.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeline.cli import build_parser
from pipeline.commands.worker import worker_config
from pipeline.models.tiny import make_tiny_model, read_manifest
from pipeline.worker.main import WorkerConfig, WorkerServer, build_app, build_worker
from pipeline.worker.protocol import ChatCompletionRequest, InvalidRequest, parse_body
from stages.capture.chat import ChatRenderer, parse_reply
from stages.capture.core import AckPolicy
from stages.capture.engine import EngineUnavailable, Generation, Sampling, VersionSpan
from stages.capture.vllm.worker import SpanPolicy, VllmWorker, weight_spans
from stages.client import RolloutClient
from stages.memory import MemoryDataPlane, RecordingSink
from topics.records import EXTRAS_WEIGHT_SPANS, CommitCoords, StagedEvent
from topics.wire import COORDS_FIELD


class FakeEngine:
    """Generates ``max_tokens`` ids counting up from 300, with a scripted text and spans."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []
        self.text = "The answer is 5."
        self.spans: tuple[VersionSpan, ...] | None = None
        self.fail: Exception | None = None
        self.version = "default"
        self.paused = False
        self.reloaded: list[str] = []

    @property
    def max_model_len(self) -> int:
        return 256

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling, request_id: str) -> Generation:
        self.prompts.append(list(prompt_ids))
        if self.fail is not None:
            raise self.fail
        ids = [300 + i for i in range(sampling.max_tokens)]
        spans = self.spans if self.spans is not None else (VersionSpan(self.version, 0, len(ids)),)
        return Generation(ids, [-0.5] * len(ids), self.text, "length", spans)

    async def pause(self) -> None:
        self.paused = True

    async def resume(self) -> None:
        self.paused = False

    async def reload_weights(self, path: str) -> None:
        self.reloaded.append(path)

    async def set_weight_version(self, version: str) -> None:
        self.version = version

    def unfinished_requests(self) -> int:
        return 0

    def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


@pytest.fixture(scope="module")
def renderer(model_dir: Path) -> ChatRenderer:
    return ChatRenderer.from_pretrained(model_dir)


class Rig:
    def __init__(self, renderer: ChatRenderer, model_dir: Path, **config: Any) -> None:
        self.engine = FakeEngine()
        self.data_plane, self.sink = MemoryDataPlane(), RecordingSink()
        self.config = WorkerConfig(model_dir=model_dir, worker_id="w", prefix_wait_s=0.05, **config)
        self.worker: VllmWorker = build_worker(
            self.config, self.engine, self.data_plane, self.sink, renderer=renderer
        )
        self.client = RolloutClient(RecordingSink())
        self.http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=build_app(self.worker, self.config)), base_url="http://w"
        )

    async def post(self, body: dict[str, Any]) -> httpx.Response:
        return await self.http.post("/v1/chat/completions", json=body)

    async def captured(
        self, messages: list[dict[str, Any]], parent: CommitCoords | None, **extra: Any
    ) -> Any:
        admission = self.client.admit("r", parent)
        response = await self.post(
            self.client.request_body({"messages": messages, "max_tokens": 3, **extra}, admission)
        )
        assert response.status_code == 200, response.text
        return response.json()


def run(rig_args: tuple[ChatRenderer, Path], body: Any, **config: Any) -> Any:
    async def go() -> Any:
        rig = Rig(*rig_args, **config)
        await rig.worker.start()
        try:
            return await body(rig)
        finally:
            await rig.http.aclose()
            await rig.worker.stop()

    return asyncio.run(go())


USER = [{"role": "user", "content": "Add 2 and 3."}]


def follow_up(reply: dict[str, Any]) -> list[dict[str, Any]]:
    message = {"role": "assistant", "content": reply["choices"][0]["message"]["content"]}
    return [*USER, message, {"role": "user", "content": "Thanks."}]


def test_continuation_is_spliced_onto_the_exact_prefix(renderer: ChatRenderer, model_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        first = await rig.captured(USER, None)
        parent = CommitCoords.model_validate(first[COORDS_FIELD])
        second = await rig.captured(follow_up(first), parent)
        coords = CommitCoords.model_validate(second[COORDS_FIELD])
        assert coords.disposition == "staged" and coords.prev_len == parent.cum_len
        exact = rig.engine.prompts[0] + [300, 301, 302]
        assert rig.engine.prompts[1][: len(exact)] == exact
        # The fake's ids are not what its text re-tokenizes to: only the splice keeps them.
        assert renderer.render(follow_up(first))[: len(exact)] != exact

    run((renderer, model_dir), body)


def test_splice_and_prefix_failures_are_served_and_reported(renderer: ChatRenderer, model_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        first = await rig.captured(USER, None)
        parent = CommitCoords.model_validate(first[COORDS_FIELD])
        # A continuation without the assistant turn cannot be spliced.
        no_turn = [*USER, {"role": "user", "content": "Hello?"}]
        reply = await rig.captured(no_turn, parent)
        coords = reply[COORDS_FIELD]
        assert (coords["disposition"], coords["failure_reason"]) == ("capture_failed", "prefix_splice_failed")
        assert rig.engine.prompts[-1] == renderer.render(no_turn)  # served from the plain render
        # A parent that no worker ever staged: prefix_unavailable after the bounded wait.
        ghost = parent.model_copy(
            update={"call_id": "ghost", "staging_key": "r/ghost", "staging_chain": ["r/ghost"]}
        )
        reply = await rig.captured(follow_up(first), ghost)
        assert reply[COORDS_FIELD]["failure_reason"] == "prefix_unavailable"
        events = rig.sink.payloads(StagedEvent)
        assert [e.coords.disposition for e in events] == ["staged", "capture_failed", "capture_failed"]  # type: ignore[attr-defined]
        metrics = (await rig.http.get("/metrics")).text
        assert (
            'tokentrail_worker_capture_failed_calls_total{code="prefix_unavailable",worker="w"} 1.0'
            in metrics
        )

    run((renderer, model_dir), body)


def test_refit_spans_recorded_or_rejected(renderer: ChatRenderer, model_dir: Path) -> None:
    straddle = (VersionSpan("0", 0, 1), VersionSpan("1", 1, 3))

    async def record(rig: Rig) -> None:
        rig.engine.spans = straddle
        reply = await rig.captured(USER, None)
        row = rig.data_plane.calls[reply[COORDS_FIELD]["staging_key"]]
        assert row.weight_version == 0 and row.extras == {EXTRAS_WEIGHT_SPANS: [[0, 0], [1, 1]]}

    async def reject(rig: Rig) -> None:
        rig.engine.spans = straddle
        reply = await rig.captured(USER, None)
        assert reply[COORDS_FIELD]["failure_reason"] == "epoch_span_rejected"

    run((renderer, model_dir), record)
    run((renderer, model_dir), reject, span_policy=SpanPolicy.REJECT)


def test_weight_spans_rules() -> None:
    assert weight_spans([VersionSpan("3", 0, 5)], 3) is None
    assert weight_spans([], 3) is None
    assert weight_spans([VersionSpan("4", 0, 5)], 3) == [[0, 4]]  # queued across a refit
    spans = [VersionSpan("3", 0, 2), VersionSpan("3", 2, 2), VersionSpan("4", 2, 4), VersionSpan("4", 4, 6)]
    assert weight_spans(spans, 3) == [[0, 3], [2, 4]]
    assert weight_spans([VersionSpan("4", 2, 5)], 3) == [[0, 3], [2, 4]]
    with pytest.raises(ValueError, match="not an integer"):
        weight_spans([VersionSpan("default", 0, 5)], 0)


def test_admin_refit_sequence_and_version_stamp(renderer: ChatRenderer, model_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        assert rig.engine.version == "0"  # labelled at start
        refused = await rig.http.post("/admin/reload_weights", json={"path": str(model_dir)})
        assert refused.status_code == 409
        missing = await rig.http.post("/admin/reload_weights", json={"path": str(model_dir / "nope")})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "path"
        for path, payload in [
            ("/admin/pause", None),
            ("/admin/reload_weights", {"path": str(model_dir)}),
            ("/admin/weight_version", {"version": 7}),
            ("/admin/resume", None),
        ]:
            response = await rig.http.post(path, json=payload)
            assert response.status_code == 200, response.text
        assert (await rig.http.get("/admin/weight_version")).json() == {"version": 7, "paused": False}
        bad = await rig.http.post("/admin/weight_version", json={"version": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "version"
        assert rig.engine.reloaded == [str(model_dir)] and rig.engine.version == "7"
        reply = await rig.captured(USER, None)
        assert reply[COORDS_FIELD]["weight_version"] == 7 and reply["weight_version"] == 7

    run((renderer, model_dir), body)


def test_engine_failure_and_oversized_requests(renderer: ChatRenderer, model_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        admission = rig.client.admit("r")
        too_long = rig.client.request_body({"messages": USER, "max_tokens": 10_000}, admission)
        response = await rig.post(too_long)
        assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
        rig.engine.fail = EngineUnavailable("boom")
        response = await rig.post(rig.client.request_body({"messages": USER}, rig.client.admit("r")))
        assert response.status_code == 503
        await rig.worker.core.writer.stop()
        failed = [e.coords.failure_reason for e in rig.sink.payloads(StagedEvent)]  # type: ignore[attr-defined]
        assert failed == ["not_served", "not_served"]  # unserved calls are reported at once

    run((renderer, model_dir), body)


def test_enqueued_policy_replies_before_staging(renderer: ChatRenderer, model_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        put_calls = rig.data_plane.put_calls

        async def slow_put(rows: Any) -> None:
            await asyncio.sleep(1.0)
            await put_calls(rows)

        rig.data_plane.put_calls = slow_put  # type: ignore[method-assign]
        reply = await asyncio.wait_for(rig.captured(USER, None), 0.8)  # does not wait for the write
        assert reply[COORDS_FIELD]["disposition"] == "staged" and rig.data_plane.calls == {}

    run((renderer, model_dir), body, ack_policy=AckPolicy.ENQUEUED)


def test_tool_calls_are_lifted_from_the_text() -> None:
    ids = iter(["call_a", "call_b"])
    text = 'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    reply = parse_reply(text, new_id=lambda: next(ids))
    assert reply.content == "Let me check."
    assert reply.tool_calls == [
        {"id": "call_a", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    ]
    broken = "<tool_call>{not json}</tool_call> and <tool_call>[1]</tool_call>"
    assert parse_reply(broken) == parse_reply(broken).__class__(content=broken, tool_calls=[])
    only = parse_reply('<tool_call>{"name": "f", "arguments": "{}"}</tool_call>')
    assert only.content is None and only.tool_calls[0]["function"]["arguments"] == "{}"


def test_tool_call_reply_over_http(renderer: ChatRenderer, model_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        rig.engine.text = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
        response = await rig.post(
            {
                "messages": USER,
                "max_tokens": 2,
                "tools": [{"type": "function", "function": {"name": "add", "parameters": {}}}],
            }
        )
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
        assert "# Tools" in renderer.tokenizer.decode(rig.engine.prompts[-1])

    run((renderer, model_dir), body)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": USER, "n": 3}, "n"),
        ({"messages": USER, "stream": True}, "stream"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": USER, "ng_capture": {"rollout_id": "r"}}, "ng_capture.call_id"),
        ({"messages": USER, "ng_capture": [1]}, "ng_capture"),
    ],
)
def test_request_validation_names_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        request = parse_body(ChatCompletionRequest, body)
        request.chat_call()
        request.admission()
    assert caught.value.param == param and param in caught.value.message


def test_request_maps_openai_fields() -> None:
    request = ChatCompletionRequest.model_validate(
        {"messages": USER, "max_tokens": 5, "max_completion_tokens": 7, "stop": "x", "logprobs": True}
    )
    call = request.chat_call()
    assert (call.max_tokens, call.stop) == (7, ("x",))
    assert request.admission() is None


def test_real_http_server_starts_serves_and_drains(renderer: ChatRenderer, model_dir: Path) -> None:
    async def go() -> None:
        engine, data_plane, sink = FakeEngine(), MemoryDataPlane(), RecordingSink()
        config = WorkerConfig(model_dir=model_dir, worker_id="w", port=0)
        worker = build_worker(config, engine, data_plane, sink, renderer=renderer)
        server = WorkerServer(build_app(worker, config), host="127.0.0.1", port=0, graceful_timeout_s=5)
        await server.start()  # the app's lifespan starts the worker
        assert server.port > 0
        client = RolloutClient(RecordingSink())
        async with httpx.AsyncClient(base_url=server.url) as http:
            assert (await http.get("/health")).json()["status"] == "ok"
            body = client.request_body({"messages": USER, "max_tokens": 2}, client.admit("r"))
            reply = (await http.post("/v1/chat/completions", json=body)).json()
        await server.stop()  # lifespan shutdown drains the writer
        assert reply[COORDS_FIELD]["disposition"] == "staged"
        assert len(sink.payloads(StagedEvent)) == 1 and worker.core.writer.backlog == 0

    asyncio.run(go())


def test_cli_verb_builds_the_worker_config(model_dir: Path) -> None:
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
        ]
    )
    config = worker_config(args)
    assert (config.port, config.ack_policy, config.worker_id) == (0, AckPolicy.ENQUEUED, "w7")
    assert config.max_body_bytes == 4096
    base = ["worker", "--model", str(model_dir), "--bootstrap", "127.0.0.1:9092"]
    assert worker_config(build_parser().parse_args(base)).max_body_bytes == 8 * 2**20
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--max-body-bytes", "0"])
    assert config.engine_settings().engine_kwargs()["logprobs_mode"] == "processed_logprobs"
    assert args.dataplane_addresses == Path("dp.json") and callable(args.run)


def test_renderer_knows_every_eos(renderer: ChatRenderer, model_dir: Path) -> None:
    manifest = read_manifest(model_dir)
    assert manifest is not None
    assert renderer.eos_token_ids == frozenset(manifest["eos_token_ids"])
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]


SIGTERM_SCRIPT = r"""
import asyncio, json, sys
from pathlib import Path
from pipeline.worker.main import WorkerConfig, run_worker
from stages.capture.engine import Generation, VersionSpan
from stages.memory import MemoryDataPlane, RecordingSink

class SlowEngine:
    max_model_len = 256
    async def generate(self, prompt_ids, sampling, request_id):
        await asyncio.sleep(1.5)
        return Generation([300, 301], [-0.5, -0.5], "ok", "length", (VersionSpan("0", 0, 2),))
    async def pause(self): pass
    async def resume(self): pass
    async def reload_weights(self, path): pass
    async def set_weight_version(self, version): pass
    def unfinished_requests(self): return 0
    def shutdown(self): pass

async def main():
    sink = RecordingSink()
    config = WorkerConfig(model_dir=Path(sys.argv[1]), worker_id="w", port=0, graceful_timeout_s=10)
    ready = lambda server: print(json.dumps({"url": server.url}), flush=True)
    await run_worker(config, data_plane=MemoryDataPlane(), sink=sink, engine=SlowEngine(), on_ready=ready)
    print(json.dumps({"staged": len(sink.events)}), flush=True)

asyncio.run(main())
"""


def test_sigterm_finishes_in_flight_requests_and_drains(model_dir: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    process = subprocess.Popen(
        [sys.executable, "-c", SIGTERM_SCRIPT, str(model_dir)],
        cwd=root,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    try:
        assert process.stdout is not None
        url = json.loads(process.stdout.readline())["url"]
        client = RolloutClient(RecordingSink())
        body = client.request_body({"messages": USER, "max_tokens": 2}, client.admit("r"))
        replies: list[httpx.Response] = []
        request = threading.Thread(
            target=lambda: replies.append(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30))
        )
        request.start()
        deadline = 50
        while deadline and not _in_flight(url):
            deadline -= 1
        process.send_signal(signal.SIGTERM)  # while the request is in the engine
        request.join(30)
        out, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0
    assert replies and replies[0].status_code == 200
    assert replies[0].json()[COORDS_FIELD]["disposition"] == "staged"
    assert json.loads(out.strip().splitlines()[-1]) == {"staged": 1}


def _in_flight(url: str) -> bool:
    """True once the server counts a request (polled through /metrics)."""
    time.sleep(0.05)
    metrics = httpx.get(f"{url}/metrics", timeout=5).text
    return 'tokentrail_worker_requests_total{worker="w"} 1.0' in metrics
