"""Replies of reasoning alone that an agent left out, put back before the worker sees them.

A reply of reasoning alone has no text and no tool calls, and frameworks send it back as
no turn at all. The worker renders the request under the chat template and splices the
chain's exact tokens into that render by counting turn ends (``stages.capture.splice``),
so every reply of the chain needs a turn there: the gateway inserts an empty assistant
turn where each left-out reply was (``lineage.left_out_replies`` says where). Its text
never reaches the engine: the splice replaces it with the reply's exact tokens. The
agent's own body is not changed, and lineage still compares the history it sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.api.protocols import Protocol
from pipeline.gateway.history import History

_EMPTY_REPLY = {"role": "assistant", "content": ""}
"""The empty assistant turn: one shape the Chat, Responses and Messages requests all accept."""


def restore_left_out(
    protocol: Protocol, body: Mapping[str, Any], history: History, positions: Sequence[int]
) -> Mapping[str, Any]:
    """``body`` with an empty assistant turn before the list element of each turn at
    ``positions`` (turn indices of ``history``); ``body`` itself when there are none."""
    if not positions:
        return body
    if protocol.turn_list is None:
        raise ValueError(f"{protocol.name} histories are text: they have no turn to put back")
    items = list(body[protocol.turn_list])
    for position in sorted(positions, reverse=True):
        source = history.sources[position]
        if source >= 0:  # a turn outside the list (instructions) never follows a reply
            items.insert(source, dict(_EMPTY_REPLY))
    return {**body, protocol.turn_list: items}


__all__ = ["restore_left_out"]
