"""The capture worker's HTTP limits and bad input, route by route, on the real engine.

The worker runs on a real uvicorn server (its own ``WorkerServer``) around the real vLLM
CPU engine (``enginekit``): bodies over the limit get 413 before they are read, and every
malformed body, unknown or unhonoured option, non-text content and bad ``ng_capture``
gets a 400 in the route's own API shape naming the field, and captures nothing. The
Kafka-event cases are in ``test_bad_events``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from badinput import SECTION
from enginekit import EngineHost, Rig, settled, start_rig

from topics.records import MAX_CHAIN_DEPTH, StagedEvent
from topics.wire import CAPTURE_FIELD, COORDS_FIELD

pytestmark = [pytest.mark.slow, pytest.mark.engine]

# The worker's body limit in these tests (the default is 8 MiB): a chain of 16,384 short keys fits.
LIMIT = 512 * 1024
USER = [{"role": "user", "content": "Add 2 and 3."}]


@pytest.fixture
def rig(host: EngineHost, model_dir: Path) -> Iterator[Rig]:
    served = start_rig(host, model_dir, max_body_bytes=LIMIT, prefix_wait_s=0.05)
    try:
        yield served
    finally:
        served.close()


def captured(rig: Rig) -> tuple[int, int]:
    """Calls staged (events with disposition ``staged``) and rows written so far."""
    staged = [
        e
        for e in rig.worker_sink.events
        if isinstance(e.payload, StagedEvent) and e.payload.coords.disposition == "staged"
    ]
    return len(staged), len(rig.data_plane.calls)


def refused_reports(rig: Rig) -> list[str]:
    """Calls reported ``not_served`` because their request was refused."""
    return [
        e.payload.coords.call_id
        for e in rig.worker_sink.events
        if isinstance(e.payload, StagedEvent) and e.payload.coords.failure_reason == "not_served"
    ]


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
    """``body`` as JSON of exactly ``size`` bytes (trailing whitespace takes the rest)."""
    out = orjson.dumps(body)
    return out + b" " * (size - len(out))


def test_oversized_http_bodies_get_413_before_they_are_read(rig: Rig, fault_report: Any) -> None:
    async def go() -> None:
        client = rig.client
        request = client.request_body({"messages": USER, "max_tokens": 2}, client.admit("r-http"))
        oversized = padded(request, 4 * LIMIT)
        # A declared length over the limit: answered on the head alone, no body sent.
        status, error = await raw_post(rig.server.port, chat_head(f"content-length: {len(oversized)}"), [])
        assert status == 413, error
        message = error["error"]["message"]
        assert error["error"]["code"] == "request_too_large", error
        assert f"the limit is {LIMIT} bytes" in message and "--max-body-bytes" in message
        # Chunked, so no length to judge by: refused once the count passes the limit.
        head = chat_head("transfer-encoding: chunked")
        status, error = await raw_post(rig.server.port, head, chunked(oversized, 8 * 1024))
        assert status == 413 and error["error"]["code"] == "request_too_large", error
        assert rig.recorder.calls == [] and captured(rig) == (0, 0)

        # The worker keeps serving, and bodies of exactly the limit pass whole, in one
        # piece or streamed in chunks.
        json_type = {"content-type": "application/json"}
        async with httpx.AsyncClient(base_url=rig.url, timeout=60) as http:
            whole = padded(request, LIMIT)
            reply = await http.post("/v1/chat/completions", content=whole, headers=json_type)
            assert reply.status_code == 200, reply.text
            assert reply.json()[COORDS_FIELD]["disposition"] == "staged"
            again = padded(
                client.request_body({"messages": USER, "max_tokens": 2}, client.admit("r-http2")), LIMIT
            )

            async def stream() -> AsyncIterator[bytes]:
                for i in range(0, len(again), 4096):
                    yield again[i : i + 4096]

            streamed = await http.post("/v1/chat/completions", content=stream(), headers=json_type)
            assert streamed.status_code == 200, streamed.text
            assert streamed.json()[COORDS_FIELD]["disposition"] == "staged"
        assert len(rig.recorder.calls) == 2 and captured(rig) == (2, 2)

    rig.host.run(go())
    fault_report.record(
        SECTION,
        "oversized HTTP body",
        injected=2,
        survived=2,
        outcome="413 request_too_large naming the limit, before the body is read (content-length, chunked)",
    )


def test_malformed_capture_gets_400_naming_the_field_and_captures_nothing(
    rig: Rig, fault_report: Any
) -> None:
    async def go() -> int:
        client = rig.client
        async with httpx.AsyncClient(base_url=rig.url, timeout=60) as http:
            first = await http.post(
                "/v1/chat/completions",
                json=client.request_body({"messages": USER, "max_tokens": 2}, client.admit("r-cap")),
            )
            assert first.status_code == 200, first.text
            parent = client.coords_from_reply(first.json())
            assert parent is not None and parent.disposition == "staged"
            before = captured(rig)
            follow_up = [
                *USER,
                {"role": "assistant", "content": "5"},
                {"role": "user", "content": "And 4 * 5?"},
            ]
            good = client.admit("r-cap", parent).model_dump(mode="json")
            too_long = [f"r-cap/k{i}" for i in range(MAX_CHAIN_DEPTH)] + [parent.staging_key]
            other = {
                **good,
                "call_id": "c-other",
                "prev_len": 0,
                "mode": "text",
                "staging_chain": None,
                "parent_chain_hash": None,
                "parent_call_id": None,
            }
            broken: list[tuple[Any, int, str, str]] = [
                ({**good, "staging_chain": []}, 1, "ng_capture.staging_chain", "empty list"),
                ({**good, "prev_len": -1}, 1, "ng_capture.prev_len", "greater than or equal to 0"),
                ({**good, "rollout_id": "r/bad"}, 1, "ng_capture.rollout_id", "pattern"),
                ({**good, "surprise": 1}, 1, "ng_capture.surprise", "Extra inputs"),
                (
                    {**good, "parent_chain_hash": None},
                    1,
                    "ng_capture.parent_chain_hash",
                    "token_in call needs",
                ),
                ({**good, "staging_chain": ["other/c1"]}, 1, "ng_capture.staging_chain", "is not of rollout"),
                (
                    {**good, "staging_chain": too_long},
                    1,
                    "ng_capture.staging_chain",
                    f"at most {MAX_CHAIN_DEPTH - 1}",
                ),
                ("not an admission", 1, "ng_capture", "valid dictionary"),
                ([good], 2, "ng_capture", "1 admissions for n=2"),
                ([good, other], 2, "ng_capture", "must continue the prefix of [0]"),
                ([good, {**good, "prev_len": "x"}], 2, "ng_capture[1].prev_len", "valid integer"),
            ]
            for capture, n, param, words in broken:
                response = await http.post(
                    "/v1/chat/completions",
                    json={"messages": follow_up, "max_tokens": 2, "n": n, CAPTURE_FIELD: capture},
                )
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert error["param"] == param and words in error["message"], (param, error)
            assert captured(rig) == before, "a refused request captured something"

            ok = await http.post(
                "/v1/chat/completions", json={"messages": follow_up, "max_tokens": 2, CAPTURE_FIELD: good}
            )
            assert ok.status_code == 200, ok.text
            child = client.coords_from_reply(ok.json())
            assert child is not None and child.disposition == "staged" and child.prev_len == parent.cum_len
            return len(broken)

    count = rig.host.run(go())
    fault_report.record(
        SECTION,
        "malformed ng_capture",
        injected=count,
        survived=count,
        outcome="400 naming ng_capture.<field> (or [i] per choice); nothing captured; the next call is captured",
    )


# Per route: a good body, then bad variants (body, expected param or None, words in the message).
IMAGE = {"type": "image_url", "image_url": {"url": "http://example.invalid/a.png"}}
ROUTES: dict[str, tuple[dict[str, Any], list[tuple[Any, str | None, str]]]] = {
    "/v1/chat/completions": (
        {"messages": USER, "max_tokens": 2},
        [
            ({"max_tokens": 2}, "messages", "Field required"),
            ({"messages": USER, "max_tokens": "many"}, "max_tokens", "valid integer"),
            ({"messages": USER, "frobnicate": 1}, "frobnicate", "unknown parameter"),
            ({"messages": USER, "store": True}, "store", "unknown parameter"),
            ({"messages": USER, "kv_transfer_params": {}}, "kv_transfer_params", "not supported"),
            ({"messages": USER, "watermarking": True}, "watermarking", "not supported"),
            (
                {"messages": [{"role": "user", "content": [IMAGE]}]},
                "messages[0].content[0].type",
                "text-only",
            ),
            (
                {"messages": USER, "truncate_prompt_tokens": 4, CAPTURE_FIELD: True},
                "truncate_prompt_tokens",
                "with ng_capture",
            ),
            ({"messages": USER, CAPTURE_FIELD: {"rollout_id": "r"}}, "ng_capture.call_id", "Field required"),
        ],
    ),
    "/v1/completions": (
        {"prompt": "2 + 3 =", "max_tokens": 2},
        [
            ({"max_tokens": 2, "prompt": None, "prompt_embeds": None}, None, "prompt"),
            ({"prompt": "x", "best_of": 2}, "best_of", "unknown parameter"),
            ({"prompt": "x", "use_beam_search": True, CAPTURE_FIELD: True}, "use_beam_search", "beam search"),
            ({"prompt": "x", "mm_payload": {}}, "mm_payload", "text-only"),
            (
                {"prompt": "x", CAPTURE_FIELD: {"rollout_id": "r", "call_id": "c"}},
                "ng_capture.prev_len",
                "Field required",
            ),
        ],
    ),
    "/v1/responses": (
        {"input": "2 + 3 =", "max_output_tokens": 2, "store": False},
        [
            ({"input": "x", "store": True}, "store", "does not store"),
            (
                {"input": "x", "store": False, "previous_response_id": "resp_1"},
                "previous_response_id",
                "does not store",
            ),
            ({"input": "x", "store": False, "service_tier": "flex"}, "service_tier", "not supported"),
            ({"input": "x", "store": False, "truncation": "auto"}, "truncation", "never drops"),
            ({"input": "x", "store": False, "modalities": ["text"]}, "modalities", "unknown parameter"),
            (
                {
                    "input": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "input_text", "text": "a"},
                                {"type": "input_image", "image_url": "http://example.invalid/a.png"},
                            ],
                        }
                    ],
                    "store": False,
                },
                "input[0].content[1].type",
                "text-only",
            ),
            ({"input": "x", "store": False, CAPTURE_FIELD: "nope"}, "ng_capture", "valid dictionary"),
        ],
    ),
    "/v1/messages": (
        {"model": "tiny", "max_tokens": 2, "messages": USER},
        [
            ({"model": "tiny", "messages": USER}, "max_tokens", "Field required"),
            (
                {"model": "tiny", "max_tokens": 2, "messages": USER, "container": "c"},
                "container",
                "unknown parameter",
            ),
            (
                {
                    "model": "tiny",
                    "max_tokens": 2,
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {
                                    "type": "image",
                                    "source": {"type": "url", "url": "http://example.invalid/a.png"},
                                }
                            ],
                        }
                    ],
                },
                "messages[0].content[0].type",
                "text-only",
            ),
            (
                {"model": "tiny", "max_tokens": 2, "messages": USER, CAPTURE_FIELD: {"rollout_id": "r"}},
                "ng_capture.call_id",
                "Field required",
            ),
        ],
    ),
}


def _error_of(path: str, response: httpx.Response) -> tuple[str | None, str]:
    """The refused parameter and message, in the route's API shape."""
    body = response.json()
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        return None, str(body["error"]["message"])
    return body["error"]["param"], str(body["error"]["message"])


def test_every_route_refuses_bad_input_in_its_own_error_shape(rig: Rig, fault_report: Any) -> None:
    async def go() -> dict[str, int]:
        counts: dict[str, int] = {}
        async with httpx.AsyncClient(base_url=rig.url, timeout=60) as http:
            for path, (_, bad) in ROUTES.items():
                refused = 0
                for raw in [b"{not json", b"[1, 2]"]:
                    response = await http.post(
                        path, content=raw, headers={"content-type": "application/json"}
                    )
                    assert response.status_code == 400, (path, response.text)
                    refused += 1
                for body, param, words in bad:
                    admitted = None
                    if body.get(CAPTURE_FIELD) is True:  # a valid admission, on a request refused
                        admitted = rig.client.admit("r-route")
                        body = {**body, CAPTURE_FIELD: admitted.model_dump(mode="json")}
                    response = await http.post(path, json=body)
                    assert response.status_code == 400, (path, body, response.text)
                    got_param, message = _error_of(path, response)
                    if path != "/v1/messages" and param is not None:
                        assert got_param == param, (path, param, got_param, message)
                    assert words in message and (param is None or param in message), (path, param, message)
                    if admitted is not None:  # reported at once, so the ledger need not wait for it
                        await settled(rig.worker.core.writer)
                        assert admitted.call_id in refused_reports(rig), (path, param)
                    refused += 1
                assert captured(rig) == (0, 0) and rig.recorder.calls == [], path
                counts[path] = refused
            # Each route still serves, and captures, a good request.
            for index, (path, (good_body, _)) in enumerate(ROUTES.items()):
                admission = rig.client.admit(f"r-good-{index}")
                await rig.client.publish_admission(admission)
                response = await http.post(
                    path, json={**good_body, CAPTURE_FIELD: admission.model_dump(mode="json")}
                )
                assert response.status_code == 200, (path, response.text)
                assert response.json()[COORDS_FIELD]["disposition"] == "staged", path
        return counts

    counts = rig.host.run(go())
    for path, count in counts.items():
        fault_report.record(
            SECTION,
            f"bad request on {path}",
            injected=count,
            survived=count,
            outcome="400 in the API's error shape naming the field; no row (a valid admission is reported not_served); the route still captures",
        )
