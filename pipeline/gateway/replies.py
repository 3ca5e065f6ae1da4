"""What the agent sees: the worker's reply without tokentrail's fields or token ids.

The worker's replies carry each choice's commit coordinates (``ng_commit_coords``, where
each protocol puts them, and each protocol finds them) and vLLM's token fields (null
unless asked for). The gateway takes the coords out for itself and strips both, at any
depth, in whole replies and in every streamed event; logprobs stay when the agent asked
for them.
"""

from __future__ import annotations

from pipeline.api import sse
from pipeline.api.protocols import Protocol
from topics.records import CommitCoords
from topics.wire import COORDS_FIELD, TOKEN_FIELDS, strip_token_fields

_MARKERS = (COORDS_FIELD, *(f'"{name}"' for name in TOKEN_FIELDS))


def hidden_fields(asked_logprobs: bool) -> frozenset[str]:
    """The keys the agent never sees."""
    hidden = {COORDS_FIELD, *TOKEN_FIELDS}
    if asked_logprobs:
        hidden.discard("logprobs")
    return frozenset(hidden)


def strip_event(
    protocol: Protocol, event: str, hidden: frozenset[str]
) -> tuple[str, dict[int, CommitCoords]]:
    """One SSE message of ``protocol``'s stream without hidden fields, and the coords it carried."""
    if not any(marker in event for marker in _MARKERS):
        return event, {}
    message = sse.message(event)
    data = message.json()
    if data is None:
        return event, {}
    return message.with_data(strip_token_fields(data, hidden)), protocol.coords_in(data)


__all__ = ["hidden_fields", "strip_event"]
