"""What the agent sees: the worker's reply without tokentrail's fields or token ids.

The worker's replies carry each choice's commit coordinates (``ng_commit_coords``, where
each protocol puts them) and vLLM's token fields (null unless asked for). The gateway
takes the coords out for itself and strips both, at any depth, in whole replies and in
every streamed event; logprobs stay when the agent asked for them.
"""

from __future__ import annotations

from typing import Any

from pipeline.api import sse
from topics.records import CommitCoords
from topics.wire import COORDS_FIELD, TOKEN_FIELDS, strip_token_fields

_MARKERS = (COORDS_FIELD, *(f'"{name}"' for name in TOKEN_FIELDS))


def hidden_fields(asked_logprobs: bool) -> frozenset[str]:
    """The keys the agent never sees."""
    hidden = {COORDS_FIELD, *TOKEN_FIELDS}
    if asked_logprobs:
        hidden.discard("logprobs")
    return frozenset(hidden)


def take_coords(value: Any) -> dict[int, CommitCoords]:
    """Each choice's coords in a reply or a streamed event (choice 0 at the top level)."""
    found: dict[int, CommitCoords] = {}
    if not isinstance(value, dict):
        return found
    for choice in value.get("choices") or ():
        if isinstance(choice, dict) and isinstance(choice.get(COORDS_FIELD), dict):
            found[int(choice.get("index", 0))] = CommitCoords.model_validate(choice[COORDS_FIELD])
    for holder in (value, value.get("response")):
        if isinstance(holder, dict) and isinstance(holder.get(COORDS_FIELD), dict) and 0 not in found:
            found[0] = CommitCoords.model_validate(holder[COORDS_FIELD])
    return found


def strip_event(event: str, hidden: frozenset[str]) -> tuple[str, dict[int, CommitCoords]]:
    """One SSE message without hidden fields, and the coords it carried."""
    if not any(marker in event for marker in _MARKERS):
        return event, {}
    message = sse.message(event)
    data = message.json()
    if data is None:
        return event, {}
    return message.with_data(strip_token_fields(data, hidden)), take_coords(data)


__all__ = ["hidden_fields", "strip_event", "take_coords"]
