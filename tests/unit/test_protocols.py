"""The protocol objects: one per API, and what the worker writes in a reply the gateway reads back."""

from __future__ import annotations

import asyncio
from typing import Any, get_args

import orjson
import pytest

from pipeline.api import sse
from pipeline.api.protocols import CHAT, COMPLETIONS, MESSAGES, PROTOCOLS, RESPONSES, Protocol
from topics.wire import COORDS_FIELD, Dialect


def coords(call_id: str) -> dict[str, Any]:
    return {
        "rollout_id": "r",
        "call_id": call_id,
        "parent_call_id": None,
        "mode": "text",
        "prev_len": 0,
        "delta_len": 1,
        "cum_len": 1,
        "weight_version": 0,
        "staging_key": f"r/{call_id}",
        "staging_chain": [f"r/{call_id}"],
        "chain_hash": "a" * 64,
        "cumulative_hash": "b" * 64,
        "digest": "c" * 64,
        "extras_digest": "d" * 64,
        "disposition": "staged",
    }


async def coords_of(index: int) -> dict[str, Any] | None:
    return coords(f"c{index}") if index < 2 else None


def event(data: dict[str, Any], name: str | None = None) -> str:
    return (f"event: {name}\n" if name else "") + f"data: {orjson.dumps(data).decode()}\n\n"


WHOLE = {
    "chat": {"choices": [{"index": 0, "message": {"role": "assistant", "content": "5"}}]},
    "completions": {"choices": [{"index": 0, "text": "5"}]},
    "responses": {"id": "resp_1", "output": []},
    "messages": {"type": "message", "content": [{"type": "text", "text": "5"}]},
}
FIRST = {
    "chat": event({"choices": [{"index": 0, "delta": {"content": "5"}, "finish_reason": None}]}),
    "completions": event({"choices": [{"index": 0, "text": "5", "finish_reason": None}]}),
    "responses": event({"type": "response.created", "response": {"id": "resp_1"}}, "response.created"),
    "messages": event({"type": "message_start", "message": {"id": "msg_1"}}, "message_start"),
}
LAST = {
    "chat": event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
    "completions": event({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}),
    "responses": event({"type": "response.completed", "response": {"id": "resp_1"}}, "response.completed"),
    "messages": event({"type": "message_delta", "delta": {"stop_reason": "end_turn"}}, "message_delta"),
}


def test_the_registry_holds_each_api_once_by_its_name() -> None:
    assert set(PROTOCOLS) == set(get_args(Dialect))
    assert all(protocol.name == name for name, protocol in PROTOCOLS.items())
    assert len({protocol.path for protocol in PROTOCOLS.values()}) == len(PROTOCOLS)
    assert list(PROTOCOLS.values()) == [CHAT, COMPLETIONS, RESPONSES, MESSAGES]


@pytest.mark.parametrize("name", list(PROTOCOLS))
def test_the_gateway_finds_the_coords_where_the_worker_put_them(name: Dialect) -> None:
    protocol = PROTOCOLS[name]

    async def run() -> tuple[dict[str, Any], str, str]:
        whole = await protocol.attach_coords(orjson.loads(orjson.dumps(WHOLE[name])), coords_of, single=True)
        first = await protocol.event_with_coords(FIRST[name], coords_of, single=True)
        last = await protocol.event_with_coords(LAST[name], coords_of, single=True)
        return whole, first, last

    whole, first, last = asyncio.run(run())
    assert {i: c.call_id for i, c in protocol.coords_in(whole).items()} == {0: "c0"}
    assert first == FIRST[name] and protocol.coords_in(sse.message(first).json()) == {}
    assert {i: c.call_id for i, c in protocol.coords_in(sse.message(last).json()).items()} == {0: "c0"}
    assert sse.message(last).event == sse.message(LAST[name]).event


@pytest.mark.parametrize("protocol", [CHAT, COMPLETIONS], ids=["chat", "completions"])
def test_each_choice_carries_its_own_coords(protocol: Protocol) -> None:
    reply = {"choices": [{"index": 1}, {"index": 0}]}
    with_coords = asyncio.run(protocol.attach_coords(reply, coords_of, single=False))
    assert COORDS_FIELD not in with_coords
    assert {i: c.call_id for i, c in protocol.coords_in(with_coords).items()} == {0: "c0", 1: "c1"}
    assert protocol.choice_count({"n": 2}) == 2 and protocol.choice_count({}) == 1


def test_the_single_reply_apis_ask_for_one_choice() -> None:
    assert RESPONSES.choice_count({"n": 3}) == MESSAGES.choice_count({"n": 3}) == 1


def test_a_responses_coords_are_not_read_from_another_apis_holder() -> None:
    """Only Responses streams carry the response object: Chat never reads coords from one."""
    wrapped = {"response": {COORDS_FIELD: coords("c0")}}
    assert RESPONSES.coords_in(wrapped)[0].call_id == "c0"
    assert CHAT.coords_in(wrapped) == {}


def test_errors_come_in_each_apis_shape() -> None:
    openai = orjson.loads(CHAT.error(400, "model: is required", param="model").body)
    assert openai == {
        "error": {
            "message": "model: is required",
            "type": "invalid_request_error",
            "param": "model",
            "code": None,
        }
    }
    assert orjson.loads(RESPONSES.error(503, "no worker").body)["error"]["type"] == "server_error"
    anthropic = MESSAGES.error(429, "max_calls: too many", param="max_calls", kind="ignored")
    assert anthropic.status_code == 429
    assert orjson.loads(anthropic.body) == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "max_calls: too many"},
    }
    assert orjson.loads(MESSAGES.error(502, "bad").body)["error"]["type"] == "api_error"
