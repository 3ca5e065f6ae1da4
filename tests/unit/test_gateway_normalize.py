"""The gateway's history normalization: what an SDK sends back equals what the gateway returned."""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

import orjson
import pytest

from pipeline.api.protocols import CHAT, COMPLETIONS, MESSAGES, PROTOCOLS, RESPONSES
from pipeline.api.protocols.turns import MalformedHistory, Turn, without_reasoning
from pipeline.gateway.history import History, extend, extended, history_of, text_digest, turn_digests
from pipeline.gateway.lineage import reasoning_rewrite
from topics.wire import Dialect


def digest_of(dialect: Dialect, body: dict[str, Any]) -> bytes:
    return history_of(PROTOCOLS[dialect], body).digest


def sse(data: Any, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n"


def chat(*messages: dict[str, Any]) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages)}


# --- equivalences ---------------------------------------------------------------------


def test_string_and_text_part_content_are_equal() -> None:
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 3?"}]
    assert digest_of("chat", chat({"role": "user", "content": "What is 2 + 3?"})) == digest_of(
        "chat", chat({"role": "user", "content": parts})
    )
    responses_parts = [{"type": "input_text", "text": "What is 2 + 3?"}]
    assert digest_of("responses", {"input": "What is 2 + 3?"}) == digest_of(
        "responses", {"input": [{"type": "message", "role": "user", "content": responses_parts}]}
    )
    assert digest_of("responses", {"input": "What is 2 + 3?"}) == digest_of(
        "responses", {"input": [{"role": "user", "content": "What is 2 + 3?"}]}
    )
    blocks = [{"type": "text", "text": "What is 2 + 3?", "cache_control": {"type": "ephemeral"}}]
    system_blocks = [{"type": "text", "text": "Be brief."}]
    assert digest_of(
        "messages", {"system": "Be brief.", "messages": [{"role": "user", "content": "What is 2 + 3?"}]}
    ) == digest_of("messages", {"system": system_blocks, "messages": [{"role": "user", "content": blocks}]})


def test_different_text_role_or_call_differ() -> None:
    base = Turn("assistant", "hi", (("calc", '{"a":1}'),))
    variants = [
        Turn("user", "hi", (("calc", '{"a":1}'),)),
        Turn("assistant", "hi ", (("calc", '{"a":1}'),)),
        Turn("assistant", "hi", (("calc2", '{"a":1}'),)),
        Turn("assistant", "hi", (("calc", '{"a":2}'),)),
        Turn("assistant", "hi"),
    ]
    assert len({base.canonical(), *(v.canonical() for v in variants)}) == len(variants) + 1
    assert digest_of("chat", chat({"role": "user", "content": "a"})) != digest_of(
        "chat", chat({"role": "user", "content": "b"})
    )


def test_canonical_layout_is_pinned() -> None:
    turn = Turn("assistant", "hi", (("f", '{"a":1}'),))
    assert turn.canonical() == b'["assistant","hi",[["f","{\\"a\\":1}"]]]'


def test_tool_call_arguments_key_order_and_whitespace_are_ignored() -> None:
    def call(arguments: Any) -> dict[str, Any]:
        tool_call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": arguments}}
        return chat({"role": "user", "content": "go"}, {"role": "assistant", "tool_calls": [tool_call]})

    compact = digest_of("chat", call('{"b":[1,2],"a":{"y":1,"x":"é"}}'))
    assert digest_of("chat", call('  {"a": {"x": "é", "y": 1},\n "b": [1, 2]} ')) == compact
    assert digest_of("chat", call({"a": {"y": 1, "x": "é"}, "b": [1, 2]})) == compact
    assert digest_of("chat", call('{"a": {"x": "é", "y": 1}, "b": [2, 1]}')) != compact
    # Unparseable arguments are kept (stripped): equal only to themselves.
    assert digest_of("chat", call("  {not json ")) == digest_of("chat", call("{not json"))
    assert digest_of("chat", call("{not json")) != digest_of("chat", call("{not  json"))


def test_ids_and_message_names_are_ignored() -> None:
    def body(call_id: str, name: str) -> dict[str, Any]:
        tool_call = {"id": call_id, "type": "function", "function": {"name": "calc", "arguments": "{}"}}
        return chat(
            {"role": "user", "content": "go", "name": name},
            {"role": "assistant", "content": None, "tool_calls": [tool_call]},
            {"role": "tool", "tool_call_id": call_id, "content": "5"},
        )

    assert digest_of("chat", body("call_1", "alice")) == digest_of("chat", body("call_2", "bob"))

    def responses(call_id: str, item_id: str) -> dict[str, Any]:
        return {
            "input": [
                {"role": "user", "content": "go"},
                {
                    "type": "function_call",
                    "id": item_id,
                    "call_id": call_id,
                    "name": "calc",
                    "arguments": "{}",
                },
                {"type": "function_call_output", "call_id": call_id, "output": "5"},
            ]
        }

    assert digest_of("responses", responses("call_1", "fc_1")) == digest_of(
        "responses", responses("c9", "fc_9")
    )

    def anthropic(tool_id: str) -> dict[str, Any]:
        use = {"type": "tool_use", "id": tool_id, "name": "calc", "input": {}}
        result = {"type": "tool_result", "tool_use_id": tool_id, "content": "5"}
        return {
            "messages": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": [use]},
                {"role": "user", "content": [result]},
            ]
        }

    assert digest_of("messages", anthropic("toolu_1")) == digest_of("messages", anthropic("toolu_2"))


def test_null_and_absent_fields_read_alike() -> None:
    assert digest_of("chat", chat({"role": "assistant"})) == digest_of(
        "chat", chat({"role": "assistant", "content": None, "tool_calls": None, "refusal": None})
    )
    assert digest_of("chat", chat({"role": "assistant", "content": ""})) == digest_of(
        "chat", chat({"role": "assistant", "tool_calls": []})
    )
    assert digest_of("responses", {"input": "x"}) == digest_of(
        "responses", {"input": "x", "instructions": None}
    )
    assert digest_of("messages", {"messages": [{"role": "user", "content": "x"}]}) == digest_of(
        "messages", {"system": None, "messages": [{"role": "user", "content": "x"}]}
    )


def test_developer_counts_as_system() -> None:
    as_system = chat({"role": "system", "content": "rules"}, {"role": "user", "content": "hi"})
    as_developer = chat({"role": "developer", "content": "rules"}, {"role": "user", "content": "hi"})
    assert digest_of("chat", as_system) == digest_of("chat", as_developer)
    # Responses instructions are the same system turn.
    dev_item = {"input": [{"role": "developer", "content": "rules"}, {"role": "user", "content": "hi"}]}
    assert digest_of("responses", {"instructions": "rules", "input": "hi"}) == digest_of(
        "responses", dev_item
    )
    assert digest_of("responses", dev_item) == digest_of("chat", as_system)


def test_consecutive_assistant_pieces_merge() -> None:
    body = {
        "input": [
            {"role": "user", "content": "go"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me "}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "see."}]},
            {"type": "function_call", "call_id": "a", "name": "calc", "arguments": '{"x": 1}'},
            {"type": "function_call", "call_id": "b", "name": "calc", "arguments": '{"x": 2}'},
        ]
    }
    assert RESPONSES.history(body) == [
        Turn("user", "go"),
        Turn("assistant", "Let me see.", (("calc", '{"x":1}'), ("calc", '{"x":2}'))),
    ]


def test_anthropic_tool_results_come_before_the_rest_of_the_message() -> None:
    body = {
        "system": "s",
        "messages": [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "sig"},
                    {"type": "tool_use", "id": "t1", "name": "calc", "input": {"x": 1}},
                    {"type": "tool_use", "id": "t2", "name": "calc", "input": {"x": 2}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "1"},
                    {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": "2"}]},
                    {"type": "text", "text": "now add them"},
                ],
            },
        ],
    }
    assert MESSAGES.history(body) == [
        Turn("system", "s"),
        Turn("user", "go"),
        Turn("assistant", "", (("calc", '{"x":1}'), ("calc", '{"x":2}'))),
        Turn("tool", "1"),
        Turn("tool", "2"),
        Turn("user", "now add them"),
    ]
    # The same conversation in chat form normalizes to the same turns after the system turn.
    same_in_chat = chat(
        {"role": "system", "content": "s"},
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "a", "function": {"name": "calc", "arguments": '{"x":1}'}},
                {"id": "b", "function": {"name": "calc", "arguments": '{"x":2}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "1"},
        {"role": "tool", "tool_call_id": "b", "content": "2"},
        {"role": "user", "content": "now add them"},
    )
    assert CHAT.history(same_in_chat) == MESSAGES.history(body)


# --- round trips: the reply, sent back by the SDK, extends the history ------------------

CHAT_REPLY: dict[str, Any] = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "model": "m",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "refusal": None,
                "reasoning_content": "I should call the tool.",
                "tool_calls": [
                    {
                        "id": "chatcmpl-tool-1",
                        "type": "function",
                        "function": {
                            "name": "calculator",
                            "arguments": '{"expression": "2 + 3", "precision": 2}',
                        },
                    }
                ],
            },
            "logprobs": None,
            "finish_reason": "tool_calls",
        }
    ],
    "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
}


def test_chat_reply_round_trip() -> None:
    body = chat({"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 2 + 3?"})
    history = history_of(CHAT, body)
    reply = CHAT.reply_turns(CHAT_REPLY)[0]
    assert reply == Turn("assistant", "", (("calculator", '{"expression":"2 + 3","precision":2}'),))
    sent_back = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "chatcmpl-tool-1",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"precision":2,"expression":"2 + 3"}'},
            }
        ],
    }
    follow_up = chat(
        *body["messages"], sent_back, {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "5"}
    )
    length, digest = extended(history, reply)
    assert length == history.length + 1 == 3
    assert history_of(CHAT, follow_up).prefix_digest(length) == digest
    # A different call sent back does not continue this reply.
    sent_back["tool_calls"][0]["function"]["arguments"] = '{"expression":"2 + 4","precision":2}'
    assert history_of(CHAT, follow_up).prefix_digest(length) != digest


RESPONSES_REPLY: dict[str, Any] = {
    "id": "resp_1",
    "object": "response",
    "status": "completed",
    "model": "m",
    "output": [
        {
            "id": "rs_1",
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "hm"}],
        },
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [
                {"type": "output_text", "text": "Let me compute.", "annotations": [], "logprobs": None}
            ],
        },
        {
            "id": "fc_1",
            "type": "function_call",
            "call_id": "call_1",
            "name": "calculator",
            "arguments": '{"expression": "2 + 3"}',
            "status": "completed",
        },
        {
            "id": "fc_2",
            "type": "function_call",
            "call_id": "call_2",
            "name": "calculator",
            "arguments": '{"expression": "4 * 5"}',
            "status": "completed",
        },
    ],
}


def test_responses_reply_round_trip() -> None:
    body = {"model": "m", "instructions": "Use tools.", "input": "What is 2 + 3 and 4 * 5?"}
    history = history_of(RESPONSES, body)
    reply = RESPONSES.reply_turns(RESPONSES_REPLY)
    assert reply == {
        0: Turn(
            "assistant",
            "Let me compute.",
            (("calculator", '{"expression":"2 + 3"}'), ("calculator", '{"expression":"4 * 5"}')),
        )
    }
    # The openai SDK's `input += response.output`, then the tool outputs.
    sent_back = copy.deepcopy(RESPONSES_REPLY["output"])
    sent_back[2]["arguments"] = '{"expression":"2 + 3"}'
    del sent_back[3]["id"], sent_back[3]["status"]
    follow_up = {
        "model": "m",
        "instructions": "Use tools.",
        "input": [
            {"role": "user", "content": "What is 2 + 3 and 4 * 5?"},
            *sent_back,
            {"type": "function_call_output", "call_id": "call_1", "output": "5"},
            {"type": "function_call_output", "call_id": "call_2", "output": "20"},
        ],
    }
    length, digest = extended(history, reply[0])
    followed = history_of(RESPONSES, follow_up)
    assert (length, followed.length) == (3, 5)
    assert followed.prefix_digest(length) == digest
    assert followed.prefix_digest(length + 1) != digest


ANTHROPIC_REPLY: dict[str, Any] = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "model": "m",
    "content": [
        {"type": "thinking", "thinking": "hm", "signature": "sig"},
        {"type": "text", "text": "Computing.", "citations": None},
        {
            "type": "tool_use",
            "id": "toolu_1",
            "name": "calculator",
            "input": {"expression": "2 + 3", "precision": 2},
        },
    ],
    "stop_reason": "tool_use",
    "stop_sequence": None,
    "usage": {"input_tokens": 10, "output_tokens": 5},
}


def test_anthropic_reply_round_trip() -> None:
    body = {
        "model": "m",
        "system": "Use tools.",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "2+3?"}],
    }
    history = history_of(MESSAGES, body)
    reply = MESSAGES.reply_turns(ANTHROPIC_REPLY)[0]
    assert reply == Turn("assistant", "Computing.", (("calculator", '{"expression":"2 + 3","precision":2}'),))
    blocks = copy.deepcopy(ANTHROPIC_REPLY["content"])
    blocks[2]["input"] = {"precision": 2, "expression": "2 + 3"}
    del blocks[1]["citations"]
    follow_up = {
        **body,
        "messages": [
            *body["messages"],
            {"role": "assistant", "content": blocks},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"}]},
        ],
    }
    length, digest = extended(history, reply)
    followed = history_of(MESSAGES, follow_up)
    assert length == 3 and followed.length == 4
    assert followed.prefix_digest(length) == digest


# --- streaming equals non-streaming -----------------------------------------------------


def chat_chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> str:
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    return sse({"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m", "choices": [choice]})


def test_chat_stream_equals_whole_reply() -> None:
    def fragment(index: int, arguments: str, **head: Any) -> dict[str, Any]:
        function = {"arguments": arguments, **({"name": head["name"]} if "name" in head else {})}
        extra = {"id": head["id"], "type": "function"} if "id" in head else {}
        return {"tool_calls": [{"index": index, **extra, "function": function}]}

    events = [
        chat_chunk(0, {"role": "assistant", "content": ""}),
        chat_chunk(1, {"role": "assistant", "content": "The ans"}),
        chat_chunk(0, {"content": "Let me "}),
        chat_chunk(0, {"content": "compute."}),
        chat_chunk(1, {"content": "wer is 5."}, "stop"),
        chat_chunk(0, fragment(0, "", id="chatcmpl-tool-1", name="calculator")),
        chat_chunk(0, fragment(0, '{"expression": ', name="")),  # the name comes with the first fragment
        "data: {not json\n\n",
        chat_chunk(0, fragment(1, '{"expression": "4 * 5"}', id="chatcmpl-tool-2", name="calculator")),
        chat_chunk(0, fragment(0, '"2 + 3", "precision": 2}')),
        chat_chunk(0, {}, "tool_calls"),
        sse(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "choices": [],
                "usage": {"total_tokens": 9},
            }
        ),
        "data: [DONE]\n\n",
    ]
    stream = CHAT.streamed_reply()
    for event in events:
        stream.feed(event)
    whole = copy.deepcopy(CHAT_REPLY)
    message = whole["choices"][0]["message"]
    message["content"] = "Let me compute."
    message["tool_calls"].append(
        {
            "id": "x",
            "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression":"4 * 5"}'},
        }
    )
    whole["choices"].append({"index": 1, "message": {"role": "assistant", "content": "The answer is 5."}})
    assert stream.turns() == CHAT.reply_turns(whole)
    assert stream.turns()[0].tool_calls == (
        ("calculator", '{"expression":"2 + 3","precision":2}'),
        ("calculator", '{"expression":"4 * 5"}'),
    )
    assert stream.turns()[1] == Turn("assistant", "The answer is 5.")


def test_completions_stream_equals_whole_reply() -> None:
    stream = COMPLETIONS.streamed_reply()
    for index, text in [(0, " 5"), (1, " fi"), (0, "\nQ:"), (1, "ve")]:
        stream.feed(
            sse({"id": "cmpl-1", "object": "text_completion", "choices": [{"index": index, "text": text}]})
        )
    stream.feed("data: [DONE]\n\n")
    whole = {"choices": [{"index": 0, "text": " 5\nQ:"}, {"index": 1, "text": " five"}]}
    assert (
        stream.turns()
        == COMPLETIONS.reply_turns(whole)
        == {
            0: Turn("assistant", " 5\nQ:"),
            1: Turn("assistant", " five"),
        }
    )


def test_responses_stream_equals_whole_reply() -> None:
    stream = RESPONSES.streamed_reply()
    in_progress = {**RESPONSES_REPLY, "status": "in_progress", "output": []}
    stream.feed(sse({"type": "response.created", "response": in_progress}, "response.created"))
    stream.feed(sse({"type": "response.output_text.delta", "delta": "Let me"}, "response.output_text.delta"))
    assert stream.turns() == {}
    completed = {"type": "response.completed", "sequence_number": 9, "response": RESPONSES_REPLY}
    stream.feed(f"event: response.completed\ndata: {orjson.dumps(completed).decode()}\n\n")
    assert stream.turns() == RESPONSES.reply_turns(RESPONSES_REPLY)
    assert stream.turns()[0].text == "Let me compute."


def anthropic_events(blocks: list[tuple[dict[str, Any], list[dict[str, Any]]]]) -> list[str]:
    start = {**ANTHROPIC_REPLY, "content": [], "stop_reason": None}
    events = [sse({"type": "message_start", "message": start}, "message_start")]
    for index, (block, deltas) in enumerate(blocks):
        events.append(
            sse(
                {"type": "content_block_start", "index": index, "content_block": block}, "content_block_start"
            )
        )
        for delta in deltas:
            events.append(
                sse({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta")
            )
        events.append(sse({"type": "content_block_stop", "index": index}, "content_block_stop"))
    delta = {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 5}}
    return [*events, sse(delta, "message_delta"), sse({"type": "message_stop"}, "message_stop")]


def test_anthropic_stream_equals_whole_reply() -> None:
    events = anthropic_events(
        [
            (
                {"type": "thinking", "thinking": "", "signature": ""},
                [
                    {"type": "thinking_delta", "thinking": "hm"},
                    {"type": "signature_delta", "signature": "sig"},
                ],
            ),
            (
                {"type": "text", "text": ""},
                [{"type": "text_delta", "text": "Comput"}, {"type": "text_delta", "text": "ing."}],
            ),
            (
                {"type": "tool_use", "id": "toolu_1", "name": "calculator", "input": {}},
                [
                    {"type": "input_json_delta", "partial_json": ""},
                    {"type": "input_json_delta", "partial_json": '{"expression": "2'},
                    {"type": "input_json_delta", "partial_json": ' + 3", "precision": 2}'},
                ],
            ),
        ]
    )
    stream = MESSAGES.streamed_reply()
    for event in events:
        stream.feed(event)
    assert stream.turns() == MESSAGES.reply_turns(ANTHROPIC_REPLY)


@pytest.mark.parametrize("deltas", [[], [{"type": "input_json_delta", "partial_json": ""}]])
def test_anthropic_stream_tool_without_input_matches_empty_input(deltas: list[dict[str, Any]]) -> None:
    events = anthropic_events([({"type": "tool_use", "id": "t", "name": "now", "input": {}}, deltas)])
    stream = MESSAGES.streamed_reply()
    for event in events:
        stream.feed(event)
    whole = {"content": [{"type": "tool_use", "id": "t", "name": "now", "input": {}}]}
    assert stream.turns() == MESSAGES.reply_turns(whole) == {0: Turn("assistant", "", (("now", "{}"),))}


# --- completions: text histories --------------------------------------------------------


def test_completions_text_prefix_digests() -> None:
    prompt = "Q: 2 + 3?\nA:"
    history = history_of(COMPLETIONS, {"model": "m", "prompt": prompt})
    assert (history.kind, history.length, history.text, history.digests) == ("text", len(prompt), prompt, ())
    assert history.digest == text_digest(prompt) == history.prefix_digest(len(prompt))
    reply = COMPLETIONS.reply_turns({"choices": [{"index": 0, "text": " 5 ✓", "finish_reason": "stop"}]})[0]
    length, digest = extended(history, reply)
    assert length == len(prompt + " 5 ✓")
    follow_up = history_of(COMPLETIONS, {"prompt": prompt + " 5 ✓\nQ: 4 * 5?\nA:"})
    assert follow_up.prefix_digest(length) == digest
    assert follow_up.prefix_digest(length + 1) != digest
    assert follow_up.prefix_digest(follow_up.length + 1) is None
    assert follow_up.prefix_digest(-1) is None
    assert history_of(COMPLETIONS, {"prompt": "Q: 2 + 3?\nA: 6"}).prefix_digest(length) != digest
    assert COMPLETIONS.history({"prompt": prompt}) == prompt  # text, compared by character prefix


def test_text_and_turn_digests_never_collide() -> None:
    assert text_digest("tokentrail-history") != turn_digests([])[0]


# --- digests ----------------------------------------------------------------------------


def test_turn_digests_chain() -> None:
    turns = [Turn("system", "s"), Turn("user", "u"), Turn("assistant", "a", (("f", "{}"),))]
    digests = turn_digests(turns)
    assert len(digests) == 4 and all(len(d) == 16 for d in digests)
    expected = hashlib.blake2b(b"tokentrail-history", digest_size=16).digest()
    assert digests[0] == expected
    for k, turn in enumerate(turns, 1):
        expected = hashlib.blake2b(expected + turn.canonical(), digest_size=16).digest()
        assert digests[k] == expected == extend(digests[k - 1], turn)
    history = History("turns", 3, tuple(digests))
    assert [history.prefix_digest(k) for k in range(5)] == [*digests, None]
    assert history.digest == digests[3]
    with pytest.raises(ValueError):
        History("turns", 3, tuple(digests[:3]))


def test_history_prefix_identifies_each_turn_count() -> None:
    body = chat(
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
    )
    full = history_of(CHAT, body)
    for k in range(5):
        prefix = history_of(CHAT, chat(*body["messages"][:k]))
        assert full.prefix_digest(k) == prefix.digest


def test_template_kwargs_give_a_history_of_its_own() -> None:
    """A history rendered with other template variables shares no prefix with this one, so
    lineage makes a call that changes them a new root; none, null or {} read alike."""
    body = chat({"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"})
    plain = history_of(CHAT, body)
    assert history_of(CHAT, {**body, "chat_template_kwargs": None}) == plain
    assert history_of(CHAT, {**body, "chat_template_kwargs": {}}) == plain
    off = history_of(CHAT, {**body, "chat_template_kwargs": {"enable_thinking": False, "x": 1}})
    same = history_of(CHAT, {**body, "chat_template_kwargs": {"x": 1, "enable_thinking": False}})
    on = history_of(CHAT, {**body, "chat_template_kwargs": {"enable_thinking": True, "x": 1}})
    assert off == same  # key order is not a difference
    assert len({plain.start, off.start, on.start}) == 3
    assert not {plain.prefix_digest(k) for k in range(3)} & {off.prefix_digest(k) for k in range(3)}
    assert history_of(COMPLETIONS, {"prompt": "p", "chat_template_kwargs": {"a": 1}}).start is None


# --- malformed histories ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("dialect", "body", "param"),
    [
        ("chat", {"model": "m"}, "messages"),
        ("chat", {"messages": "hi"}, "messages"),
        ("chat", {"messages": [{"role": "user", "content": "a"}, "b"]}, "messages[1]"),
        (
            "chat",
            {"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]},
            "messages[1].role",
        ),
        ("chat", {"messages": [{"content": "a"}]}, "messages[0].role"),
        (
            "chat",
            {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": 7}]},
            "messages[1].content",
        ),
        (
            "chat",
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}
                ]
            },
            "messages[0].content[1].type",
        ),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
            "messages[0].content[0].text",
        ),
        (
            "chat",
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "x", "type": "function"}]}]},
            "messages[0].tool_calls[0].function",
        ),
        ("responses", {"model": "m"}, "input"),
        ("responses", {"input": 3}, "input"),
        ("responses", {"input": [{"type": "web_search_call", "id": "ws"}]}, "input[0].type"),
        ("responses", {"input": [{"content": "no role, no type"}]}, "input[0].type"),
        ("responses", {"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ("responses", {"instructions": ["x"], "input": "hi"}, "instructions"),
        ("messages", {"system": "s"}, "messages"),
        ("messages", {"messages": [{"role": "system", "content": "s"}]}, "messages[0].role"),
        (
            "messages",
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].type",
        ),
        ("messages", {"messages": [{"role": "user", "content": {"text": "x"}}]}, "messages[0].content"),
        ("messages", {"system": 5, "messages": []}, "system"),
        ("chat", {"messages": [], "chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
        ("completions", {"prompt": [1, 2, 3]}, "prompt"),
        ("completions", {"model": "m"}, "prompt"),
    ],
)
def test_malformed_history_names_the_field(dialect: Dialect, body: dict[str, Any], param: str) -> None:
    with pytest.raises(MalformedHistory) as caught:
        history_of(PROTOCOLS[dialect], body)
    assert caught.value.param == param
    assert caught.value.message.startswith(f"{param}: ")
    assert isinstance(caught.value, ValueError)


def test_malformed_replies_name_the_field() -> None:
    with pytest.raises(MalformedHistory) as caught:
        CHAT.reply_turns({"choices": [{"index": 0}]})
    assert caught.value.param == "choices[0].message"
    with pytest.raises(MalformedHistory) as caught:
        RESPONSES.reply_turns({"output": [{"type": "function_call_output", "output": "x"}]})
    assert caught.value.param == "output"
    # A stream whose blocks cannot be normalized has no turns rather than failing the agent's stream.
    stream = MESSAGES.streamed_reply()
    for event in anthropic_events([({"type": "server_tool_use", "id": "s", "name": "web"}, [])]):
        stream.feed(event)
    assert stream.turns() == {}


# --- reasoning rewritten by the agent -----------------------------------------------------

REASONED = "<think>\nAdd them.\n</think>\n\nThe answer is 5."


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (REASONED, ("The answer is 5.", "tags")),
        ("The answer is 5.", ("The answer is 5.", "")),
        ("\n\nAdd them.\n</think>\n\nThe answer is 5.", ("The answer is 5.", "closing")),  # opener replaced
        ("Add them.</think>The answer is 5.", ("The answer is 5.", "closing")),  # R1: opened in the prompt
        ("The answer is <think>\nstill think", ("The answer is", "unclosed")),  # cut short
        ("<think>a</think>x<think>b</think>y", ("xy", "tags")),
    ],
)
def test_reasoning_is_taken_out_of_assistant_text(text: str, expected: tuple[str, str]) -> None:
    assert without_reasoning(text) == expected


def test_a_reply_continues_however_its_reasoning_comes_back() -> None:
    """The reply as served (reasoning in a field, or inline) and every way a framework sends
    it back (dropped, moved into tags, the opening tag replaced by a blank line) are one
    history; the way it travelled is kept beside the turn to count the rewrite."""
    question = {"role": "user", "content": "What is 2 + 3?"}
    history = history_of(CHAT, chat(question))
    served = {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "The answer is 5.", "reasoning": "Add them."},
            }
        ]
    }
    inline = {"choices": [{"index": 0, "message": {"role": "assistant", "content": REASONED}}]}
    for reply in (served, inline):
        turn = CHAT.reply_turns(reply)[0]
        length, digest = extended(history, turn)
        for sent_back, kind in [
            ({"role": "assistant", "content": "The answer is 5."}, ""),
            ({"role": "assistant", "content": REASONED}, "tags"),
            ({"role": "assistant", "content": "\n\nAdd them.\n</think>\n\nThe answer is 5."}, "closing"),
            ({"role": "assistant", "content": "The answer is 5.", "reasoning_content": "Add them."}, "field"),
        ]:
            follow_up = history_of(CHAT, chat(question, sent_back, {"role": "user", "content": "And 4?"}))
            assert follow_up.prefix_digest(length) == digest, (reply, sent_back)
            assert follow_up.reasoning[length - 1] == kind
    assert CHAT.reply_turns(served)[0].reasoning == "field"
    assert CHAT.reply_turns(inline)[0].reasoning == "tags"
    edited = chat(
        question, {"role": "assistant", "content": "The answer is 6."}, {"role": "user", "content": "?"}
    )
    assert history_of(CHAT, edited).prefix_digest(length) != digest  # a real rewrite is not reasoning


def test_reasoning_in_each_api_s_own_place_is_a_field() -> None:
    responses = RESPONSES.reply_turns(RESPONSES_REPLY)[0]
    assert responses.reasoning == "field" and responses.text == "Let me compute."
    thinking = {
        "content": [{"type": "thinking", "thinking": "hm", "signature": "s"}, {"type": "text", "text": "5"}]
    }
    assert (
        MESSAGES.reply_turns(thinking)[0] == Turn("assistant", "5")
        and MESSAGES.reply_turns(thinking)[0].reasoning == "field"
    )
    stream = CHAT.streamed_reply()
    stream.feed(sse({"choices": [{"index": 0, "delta": {"reasoning": "hm"}}]}))
    stream.feed(sse({"choices": [{"index": 0, "delta": {"content": "5"}}]}))
    assert stream.turns()[0] == Turn("assistant", "5") and stream.turns()[0].reasoning == "field"


@pytest.mark.parametrize(
    ("replied", "sent_back", "kind"),
    [
        ("field", "", "dropped"),
        ("tags", "", "dropped"),
        ("field", "tags", "moved_to_content"),
        ("tags", "field", "moved_to_field"),
        ("tags", "closing", "opening_tag_replaced"),
        ("tags", "unclosed", "closing_tag_lost"),
        ("tags", "tags", None),
        ("", "", None),
    ],
)
def test_each_rewrite_has_a_name(replied: str, sent_back: str, kind: str | None) -> None:
    assert reasoning_rewrite(replied, sent_back) == kind
