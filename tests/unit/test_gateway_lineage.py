"""Lineage through replies of reasoning alone that agents send back as no turn at all."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.api.protocols import CHAT, PROTOCOLS
from pipeline.api.protocols.turns import Turn
from pipeline.gateway.history import History, extended, history_of
from pipeline.gateway.leftout import restore_left_out
from pipeline.gateway.lineage import GatewayCall, left_out_replies, resolve
from topics.wire import Dialect

QUESTION = {"role": "user", "content": "What is 2 + 3?"}
AGAIN = {"role": "user", "content": "And then?"}
SAID = {"role": "assistant", "content": "Five."}


def answered(call_id: str, history: History, reply: Turn, parent: GatewayCall | None = None) -> GatewayCall:
    call = GatewayCall(
        call_id, call_id, parent.call_id if parent else None, "turns", history.length, history.digest
    )
    call.answered(*extended(history, reply), None, "w", reply.reasoning, reply.empty)
    return call


def recovered(call_id: str, history: History, parent: GatewayCall | None = None) -> GatewayCall:
    """A call as a restarted gateway rebuilds it: its request digest only."""
    return GatewayCall(
        call_id,
        call_id,
        parent.call_id if parent else None,
        "turns",
        history.length,
        history.digest,
        recovered=True,
    )


def tree(*calls: GatewayCall) -> dict[str, GatewayCall]:
    return {call.call_id: call for call in calls}


THOUGHT = Turn("assistant", "", reasoning="field")


def test_a_reasoning_only_reply_left_out_is_still_the_parent() -> None:
    first = history_of(CHAT, {"messages": [QUESTION]})
    one = answered("c1", first, THOUGHT)
    second = history_of(CHAT, {"messages": [QUESTION, AGAIN]})
    assert resolve([one], second, tree(one)).parent is one
    assert left_out_replies(one, second, tree(one)) == (1,)
    sent_back = history_of(CHAT, {"messages": [QUESTION, {"role": "assistant", "content": ""}, AGAIN]})
    assert resolve([one], sent_back, tree(one)).parent is one
    assert left_out_replies(one, sent_back, tree(one)) == ()  # sent back: nothing to put back


def test_a_reply_with_text_left_out_is_a_rewrite() -> None:
    """The agent dropped what the model said: that history is not the reply's continuation."""
    first = history_of(CHAT, {"messages": [QUESTION]})
    one = answered("c1", first, Turn("assistant", "Five."))
    second = history_of(CHAT, {"messages": [QUESTION, AGAIN]})
    assert resolve([one], second, tree(one)).parent is None
    assert left_out_replies(None, second, {}) == ()


def test_every_left_out_reply_of_the_chain_is_found_from_the_history() -> None:
    """Two replies left out, one sent back, the chain partly rebuilt from the log: the
    positions come from the new history and the ancestors' request digests alone."""
    h1 = [QUESTION]
    h2 = [*h1, AGAIN]  # c1's reply left out
    h3 = [*h2, SAID, AGAIN]  # c2's reply sent back
    h4 = [*h3, AGAIN]  # c3's reply left out
    one = recovered("c1", history_of(CHAT, {"messages": h1}))
    two = recovered("c2", history_of(CHAT, {"messages": h2}), one)
    three = answered("c3", history_of(CHAT, {"messages": h3}), THOUGHT, two)
    calls = tree(one, two, three)
    fourth = history_of(CHAT, {"messages": h4})
    assert resolve(list(calls.values()), fourth, calls).parent is three
    assert left_out_replies(three, fourth, calls) == (1, 4)


@pytest.mark.parametrize(
    ("dialect", "body", "key"),
    [
        ("chat", {"messages": [{"role": "system", "content": "Be brief."}, QUESTION, AGAIN]}, "messages"),
        ("responses", {"instructions": "Be brief.", "input": [QUESTION, AGAIN]}, "input"),
        ("messages", {"system": "Be brief.", "messages": [QUESTION, AGAIN]}, "messages"),
    ],
)
def test_the_left_out_reply_goes_back_where_it_was(dialect: Dialect, body: dict[str, Any], key: str) -> None:
    """The worker gets an empty assistant turn between the question and the next turn; the
    agent's body is left as it was, and the restored body reads as the reply sent back."""
    history = history_of(PROTOCOLS[dialect], body)
    position = history.roles.index("user") + 1
    restored = restore_left_out(PROTOCOLS[dialect], body, history, [position])
    assert restored[key] == [*body[key][:-1], {"role": "assistant", "content": ""}, AGAIN]
    assert body[key][-2:] == [QUESTION, AGAIN]
    assert history_of(PROTOCOLS[dialect], restored).roles == ("system", "user", "assistant", "user")
    assert restore_left_out(PROTOCOLS[dialect], body, history, []) is body
