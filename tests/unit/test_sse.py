"""One reader of server-sent events for the worker's and the gateway's streams."""

from __future__ import annotations

import orjson

from pipeline.api import sse
from pipeline.api.protocols import CHAT
from pipeline.gateway.replies import hidden_fields, strip_event
from topics.wire import COORDS_FIELD

COORDS = {
    "rollout_id": "r",
    "call_id": "c",
    "parent_call_id": None,
    "mode": "text",
    "prev_len": 0,
    "delta_len": 1,
    "cum_len": 1,
    "weight_version": 0,
    "staging_key": "r/c",
    "staging_chain": ["r/c"],
    "chain_hash": "a" * 64,
    "cumulative_hash": "b" * 64,
    "digest": "c" * 64,
    "extras_digest": "d" * 64,
    "disposition": "staged",
}


def test_the_format_s_variants_read_alike() -> None:
    """With or without the space, over several lines, any line end, comments and ids kept."""
    (spaced,) = sse.messages('event: done\ndata: {"a": 1}\n\n')
    (tight,) = sse.messages('event:done\r\ndata:{"a": 1}\r\n\r\n')
    assert spaced.event == tight.event == "done" and spaced.json() == tight.json() == {"a": 1}
    (split,) = sse.messages(': a comment\nid: 7\ndata: {"a":\ndata: 1}\n\n')
    assert split.data == '{"a":\n1}' and split.json() == {"a": 1}
    assert split.head == ": a comment\nid: 7\n" and split.event is None
    assert [m.json() for m in sse.messages("data: [DONE]\n\ndata: not json\n\n")] == [None, None]
    assert sse.message("event: ping\n\n").data is None


def test_a_message_is_rewritten_with_its_other_lines_as_sent() -> None:
    message = sse.message("event: message_delta\rid: 3\rdata:{}\r\r")
    assert message.with_data({"b": 2}) == 'event: message_delta\nid: 3\ndata: {"b":2}\n\n'


def test_the_gateway_strips_coords_from_data_sent_without_a_space() -> None:
    chunk = {"choices": [{"index": 0, "finish_reason": "stop", COORDS_FIELD: COORDS}]}
    stripped, coords = strip_event(CHAT, f"data:{orjson.dumps(chunk).decode()}\n\n", hidden_fields(False))
    assert COORDS_FIELD not in stripped and coords[0].call_id == "c"
    assert sse.message(stripped).json() == {"choices": [{"index": 0, "finish_reason": "stop"}]}


def test_a_streamed_reply_reads_multi_line_data() -> None:
    reply = CHAT.streamed_reply()
    reply.feed(
        'data: {"choices": [{"index": 0,\ndata:  "delta": {"role": "assistant", "content": "hi"}}]}\n\n'
    )
    reply.feed('data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n')
    assert reply.turns()[0].text == "hi"
