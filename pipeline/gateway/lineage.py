"""Lineage without the agent's help: which earlier call a request continues.

Each call of a session remembers the digest of its normalized request history and,
once the gateway has returned its reply, of that history plus the reply
(``pipeline.gateway.normalize``). A new request's parent is the call whose extended
history is the longest prefix of the new history (the most recent on a tie): a
``token_in`` child. A request whose whole history equals an earlier call's request is a
retry of it: a sibling under the same parent with the same logical call id, so the
ledger collapses the attempts. Anything else starts a new root (the history was
rewritten: compaction, truncation, a sub-agent).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.gateway.normalize import History
from topics.records import CommitCoords


@dataclass(slots=True)
class GatewayCall:
    """One call of a session, as lineage needs it; the reply fields fill in once it is answered."""

    call_id: str
    logical_call_id: str
    parent_call_id: str | None
    kind: str
    request_length: int
    request_digest: bytes
    extended_length: int | None = None
    extended_digest: bytes | None = None
    coords: CommitCoords | None = None
    worker: str | None = None

    def answered(self, length: int, digest: bytes, coords: CommitCoords | None, worker: str) -> None:
        self.extended_length, self.extended_digest = length, digest
        self.coords, self.worker = coords, worker


@dataclass(frozen=True, slots=True)
class Resolution:
    """The parent of a new call (None: a root), and the call it retries, if any."""

    parent: GatewayCall | None
    retry_of: GatewayCall | None = None


def resolve(calls: Sequence[GatewayCall], history: History, parents: dict[str, GatewayCall]) -> Resolution:
    """The new call's place in the session's tree (``parents``: calls by id)."""
    for call in reversed(calls):
        if (
            call.kind == history.kind
            and call.request_length == history.length
            and call.request_digest == history.digest
        ):
            parent = parents.get(call.parent_call_id) if call.parent_call_id else None
            return Resolution(parent, retry_of=call)
    best: GatewayCall | None = None
    for call in reversed(calls):
        if call.kind != history.kind or call.extended_length is None or call.extended_digest is None:
            continue
        if best is not None and call.extended_length <= (best.extended_length or 0):
            continue
        if (
            call.extended_length <= history.length
            and history.prefix_digest(call.extended_length) == call.extended_digest
        ):
            best = call
    return Resolution(best)


def logical_call_id(history: History) -> str:
    """The same history always gets the same logical id: its retries collapse in the ledger."""
    return f"h{history.kind[0]}{history.length}-{history.digest.hex()[:24]}"


__all__ = ["GatewayCall", "Resolution", "logical_call_id", "resolve"]
