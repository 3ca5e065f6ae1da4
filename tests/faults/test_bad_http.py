"""The capture worker's HTTP limits: bad requests and oversized bodies.

The worker runs on a real uvicorn server (its own ``WorkerServer``) around a scripted
engine: bodies over the limit get 413 before they are read, malformed requests get 400
naming the field, and neither captures anything. The Kafka-event cases are in
``test_bad_events``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from badinput import SECTION

from pipeline.models.tiny import make_tiny_model
from pipeline.worker.main import WorkerConfig, WorkerServer, build_app, build_worker
from stages.capture.chat import ChatRenderer
from stages.capture.engine import Generation, Sampling, VersionSpan
from stages.client import RolloutClient
from stages.memory import MemoryDataPlane, RecordingSink
from topics.records import MAX_CHAIN_DEPTH
from topics.wire import COORDS_FIELD

# The worker's body limit in these tests (the default is 8 MiB): a chain of 16,384 short keys fits.
LIMIT = 512 * 1024
USER = [{"role": "user", "content": "Add 2 and 3."}]


class ScriptedEngine:
    """Generates ``max_tokens`` ids counting up from 300; remembers every prompt."""

    max_model_len = 256

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling, request_id: str) -> Generation:
        self.prompts.append(list(prompt_ids))
        ids = [300 + i for i in range(sampling.max_tokens)]
        return Generation(
            ids, [-0.5] * len(ids), "The answer is 5.", "length", (VersionSpan("0", 0, len(ids)),)
        )

    async def pause(self) -> None:
        pass

    async def resume(self) -> None:
        pass

    async def reload_weights(self, path: str) -> None:
        pass

    async def set_weight_version(self, version: str) -> None:
        pass

    def unfinished_requests(self) -> int:
        return 0

    def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ChatRenderer]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)
    return model_dir, ChatRenderer.from_pretrained(model_dir)


@dataclass
class Worker:
    engine: ScriptedEngine
    data_plane: MemoryDataPlane
    sink: RecordingSink
    server: WorkerServer
    client: RolloutClient

    def captured(self) -> tuple[int, int]:
        """Staged events published and rows written so far."""
        return len(self.sink.events), len(self.data_plane.calls)


@contextlib.asynccontextmanager
async def worker_serving(tiny: tuple[Path, ChatRenderer]) -> AsyncIterator[Worker]:
    """A real uvicorn server (the worker's own) around the scripted engine."""
    model_dir, renderer = tiny
    engine, plane, sink = ScriptedEngine(), MemoryDataPlane(), RecordingSink()
    config = WorkerConfig(
        model_dir=model_dir, worker_id="w-bad", port=0, max_body_bytes=LIMIT, prefix_wait_s=0.05
    )
    worker = build_worker(config, engine, plane, sink, renderer=renderer)
    server = WorkerServer(build_app(worker, config), host="127.0.0.1", port=0, graceful_timeout_s=5)
    await server.start()
    try:
        yield Worker(engine, plane, sink, server, RolloutClient(RecordingSink()))
    finally:
        await server.stop()


async def raw_post(port: int, head: bytes, chunks: Sequence[bytes]) -> tuple[int, dict[str, Any]]:
    """Send a request head and then body chunks until the server answers; its answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answer = asyncio.ensure_future(reader.read())  # the server closes after a refusal
    try:
        writer.write(head)
        for chunk in chunks:
            if answer.done():
                break
            writer.write(chunk)
            try:
                await asyncio.wait_for(writer.drain(), 5)
            except (ConnectionError, TimeoutError):
                break  # the server stopped reading: its answer is on the way
            await asyncio.sleep(0.001)
        data = await asyncio.wait_for(answer, 10)
    finally:
        writer.close()
    status_line, _, rest = data.partition(b"\r\n")
    _, _, body = rest.partition(b"\r\n\r\n")
    return int(status_line.split()[1]), orjson.loads(body)


def chat_head(extra: str) -> bytes:
    return (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: worker\r\ncontent-type: application/json\r\n"
        f"{extra}\r\n\r\n"
    ).encode()


def chunked(body: bytes, size: int) -> list[bytes]:
    parts = [body[i : i + size] for i in range(0, len(body), size)]
    return [f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in parts] + [b"0\r\n\r\n"]


def padded(body: dict[str, Any], size: int) -> bytes:
    """``body`` as JSON of exactly ``size`` bytes (an ignored field takes the rest)."""
    bare = orjson.dumps({**body, "padding": ""})
    out = orjson.dumps({**body, "padding": "x" * (size - len(bare))})
    assert len(out) == size
    return out


def test_oversized_http_bodies_get_413_before_they_are_read(
    tiny: tuple[Path, ChatRenderer], fault_report: Any
) -> None:
    async def go() -> None:
        async with worker_serving(tiny) as w:
            request = w.client.request_body({"messages": USER, "max_tokens": 2}, w.client.admit("r-http"))
            oversized = padded(request, 4 * LIMIT)
            # A declared length over the limit: answered on the head alone, no body sent.
            status, error = await raw_post(w.server.port, chat_head(f"content-length: {len(oversized)}"), [])
            assert status == 413, error
            message = error["error"]["message"]
            assert error["error"]["code"] == "request_too_large", error
            assert f"the limit is {LIMIT} bytes" in message and "--max-body-bytes" in message
            # Chunked, so no length to judge by: refused once the count passes the limit.
            head = chat_head("transfer-encoding: chunked")
            status, error = await raw_post(w.server.port, head, chunked(oversized, 8 * 1024))
            assert status == 413 and error["error"]["code"] == "request_too_large", error
            assert w.engine.prompts == [] and w.captured() == (0, 0)

            # The worker keeps serving, and bodies of exactly the limit pass whole, in
            # one piece or streamed in chunks.
            json_type = {"content-type": "application/json"}
            async with httpx.AsyncClient(base_url=w.server.url, timeout=30) as http:
                whole = padded(request, LIMIT)
                reply = await http.post("/v1/chat/completions", content=whole, headers=json_type)
                assert reply.status_code == 200, reply.text
                assert reply.json()[COORDS_FIELD]["disposition"] == "staged"
                again = padded(w.client.request_body({"messages": USER}, w.client.admit("r-http2")), LIMIT)

                async def stream() -> AsyncIterator[bytes]:
                    for i in range(0, len(again), 4096):
                        yield again[i : i + 4096]

                streamed = await http.post("/v1/chat/completions", content=stream(), headers=json_type)
                assert streamed.status_code == 200, streamed.text
                assert streamed.json()[COORDS_FIELD]["disposition"] == "staged"
            assert len(w.engine.prompts) == 2 and w.captured() == (2, 2)

    asyncio.run(go())
    fault_report.record(
        SECTION,
        "oversized HTTP body",
        injected=2,
        survived=2,
        outcome="413 request_too_large naming the limit, before the body is read (content-length, chunked)",
    )


def test_malformed_requests_get_400_naming_the_field_and_capture_nothing(
    tiny: tuple[Path, ChatRenderer], fault_report: Any
) -> None:
    async def go() -> int:
        async with worker_serving(tiny) as w, httpx.AsyncClient(base_url=w.server.url, timeout=30) as http:
            first = await http.post(
                "/v1/chat/completions",
                json=w.client.request_body({"messages": USER, "max_tokens": 2}, w.client.admit("r-cap")),
            )
            assert first.status_code == 200, first.text
            parent = w.client.coords_from_reply(first.json())
            assert parent is not None and parent.disposition == "staged"
            before = w.captured()
            follow_up = [
                *USER,
                {"role": "assistant", "content": "5"},
                {"role": "user", "content": "And 4 * 5?"},
            ]
            good = w.client.admit("r-cap", parent).model_dump(mode="json")
            too_long = [f"r-cap/k{i}" for i in range(MAX_CHAIN_DEPTH)] + [parent.staging_key]
            broken: list[tuple[Any, str, str]] = [
                ({**good, "staging_chain": []}, "ng_capture.staging_chain", "empty list"),
                ({**good, "prev_len": -1}, "ng_capture.prev_len", "greater than or equal to 0"),
                ({**good, "rollout_id": "r/bad"}, "ng_capture.rollout_id", "pattern"),
                ({**good, "surprise": 1}, "ng_capture.surprise", "Extra inputs"),
                ({**good, "parent_chain_hash": None}, "ng_capture.parent_chain_hash", "token_in call needs"),
                ({**good, "staging_chain": ["other/c1"]}, "ng_capture.staging_chain", "is not of rollout"),
                (
                    {**good, "staging_chain": too_long},
                    "ng_capture.staging_chain",
                    f"at most {MAX_CHAIN_DEPTH - 1}",
                ),
                ("not an admission", "ng_capture", "valid dictionary"),
            ]
            for capture, param, words in broken:
                response = await http.post(
                    "/v1/chat/completions",
                    json={"messages": follow_up, "max_tokens": 2, "ng_capture": capture},
                )
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert error["param"] == param and words in error["message"], (param, error)
            for raw_body in [b'{"messages": [', b"\xff\xfe\x00"]:
                response = await http.post(
                    "/v1/chat/completions", content=raw_body, headers={"content-type": "application/json"}
                )
                assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
            assert w.captured() == before, "a refused request captured something"

            ok = await http.post(
                "/v1/chat/completions", json={"messages": follow_up, "max_tokens": 2, "ng_capture": good}
            )
            assert ok.status_code == 200, ok.text
            child = w.client.coords_from_reply(ok.json())
            assert child is not None and child.disposition == "staged" and child.prev_len == parent.cum_len
            return len(broken)

    count = asyncio.run(go())
    fault_report.record(
        SECTION,
        "malformed ng_capture",
        injected=count,
        survived=count,
        outcome="400 naming ng_capture.<field>; nothing captured; the next call is captured",
    )
    fault_report.record(
        SECTION, "malformed HTTP body", injected=2, survived=2, outcome="400 'body: not valid JSON'"
    )
