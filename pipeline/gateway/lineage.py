"""Lineage without the agent's help: which earlier call a request continues.

Each call of a session remembers the digest of its normalized request history and,
once the gateway has returned its reply, of that history plus the reply
(``pipeline.gateway.history``). A call rebuilt from the log after a restart
(``recovery``) knows only its request digest: it continues into a history that has it
as a prefix followed by an assistant turn (the reply, as the agent sends it back). A new request's parent is the call whose extended
history is the longest prefix of the new history (the most recent on a tie): a
``token_in`` child. A request whose whole history equals an earlier call's request is a
retry of it: a sibling under the same parent with the same logical call id, so the
ledger collapses the attempts. Anything else starts a new root (the history was
rewritten: compaction, truncation, a sub-agent). A reply of reasoning alone may come
back as no turn at all (``left_out_replies``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipeline.gateway.history import History
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
    recovered: bool = False
    template_start: bytes | None = None
    """The empty history's digest under the call's template variables (turn histories)."""
    reply_reasoning: str = ""
    """How the reply carried reasoning (``Turn.reasoning``), to name what the agent made of it."""
    reply_empty: bool = False
    """The reply held reasoning alone (``Turn.empty``): an agent may send it back as no turn."""

    def answered(
        self,
        length: int,
        digest: bytes,
        coords: CommitCoords | None,
        worker: str,
        reasoning: str = "",
        empty: bool = False,
    ) -> None:
        self.extended_length, self.extended_digest = length, digest
        self.coords, self.worker = coords, worker
        self.reply_reasoning, self.reply_empty = reasoning, empty


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
    best_length = -1
    for call in reversed(calls):
        length = _continued_length(call, history)
        if length is not None and length > best_length:
            best, best_length = call, length
    return Resolution(best)


def _continued_length(call: GatewayCall, history: History) -> int | None:
    """How much of ``history`` is ``call``'s conversation with its reply, if it continues it."""
    if call.kind != history.kind:
        return None
    if call.reply_empty and _left_out(call, history):
        return call.request_length
    if call.extended_length is not None and call.extended_digest is not None:
        length = call.extended_length
        if length <= history.length and history.prefix_digest(length) == call.extended_digest:
            return length
        return None
    if (
        call.recovered
        and call.coords is not None
        and history.role(call.request_length) == "assistant"
        and history.prefix_digest(call.request_length) == call.request_digest
    ):
        return call.request_length + 1
    return None


def _left_out(call: GatewayCall, history: History) -> bool:
    """``history`` continues ``call``'s request with no turn for its reply: a reply of
    reasoning alone, which frameworks send back as nothing (pydantic-ai maps a response of
    thinking parts to no message; openai-agents drops a reasoning item no message follows).
    An empty reply holds nothing the agent could have kept, so this is no rewrite."""
    return (
        call.kind == history.kind == "turns"
        and history.role(call.request_length) not in ("assistant", None)
        and history.prefix_digest(call.request_length) == call.request_digest
    )


def left_out_replies(
    parent: GatewayCall | None, history: History, parents: Mapping[str, GatewayCall]
) -> tuple[int, ...]:
    """Where ``history`` left out a reply of its chain (``parent`` and its ancestors): the
    positions of the turns that follow each one, ascending.

    The worker splices the chain's exact tokens under a render of the request, and that
    render must close one turn per reply (``stages.capture.splice``), so the gateway puts an
    empty assistant turn back at each position (``restore``). Read from the history
    itself, not remembered: a call rebuilt from the log finds its chain's positions too.
    In a chain the agent continued, an ancestor's request is a prefix of the history,
    followed by an assistant turn unless that ancestor's reply was left out."""
    positions = []
    call = parent
    while call is not None:
        if _left_out(call, history):
            positions.append(call.request_length)
        call = parents.get(call.parent_call_id) if call.parent_call_id else None
    return tuple(sorted(positions))


def reasoning_rewrite(replied: str, sent_back: str) -> str | None:
    """What the agent did to a reply's reasoning before sending it back (``Turn.reasoning``
    of each), or None when it came back as it went: ``dropped``, ``moved_to_content`` (into
    ``<think>`` tags), ``moved_to_field``, ``opening_tag_replaced`` (a ``</think>`` left
    without its opener, as frameworks that parse thinking tags send it back), or
    ``closing_tag_lost``. Lineage already matched the two without their reasoning."""
    if replied == sent_back:
        return None
    return {
        "": "dropped",
        "tags": "moved_to_content",
        "field": "moved_to_field",
        "closing": "opening_tag_replaced",
        "unclosed": "closing_tag_lost",
    }[sent_back]


def episode_end(calls: Sequence[GatewayCall]) -> str | None:
    """The call a ``terminal`` seal declares as the episode's end when the session's calls do
    not form one chain (several roots or several leaves), else None.

    The argument: the environment rewarded the episode the agent played, and the agent's
    last call is where that episode ended. Several roots are a history the agent rewrote
    (an edit, a summary); several leaves under one root are a turn the agent sent back
    changed (a framework that rewrites a reply's ``<think>`` makes the next call continue
    an earlier one), so the earlier branch is a draft of the episode. Left to the ledger,
    either is several leaves, and ``terminal`` would reject a rewarded rollout as
    ``ambiguous_terminal``. So the seal names the last call admitted, and the ledger takes
    the chain ending there as the sample (or rejects it with that call's own code if it
    failed, as it would a unique leaf). None when the calls form one chain (the ledger's
    unique leaf is the episode) or when the last call is one of several choices of one
    request (``n`` > 1: which of them ended the episode is truly ambiguous, and stays so).
    Leaves count logical calls, so a retry is no second leaf."""
    if not calls:
        return None
    roots = {call.logical_call_id for call in calls if call.parent_call_id is None}
    if _CHOICE.search(calls[-1].logical_call_id) or (len(roots) < 2 and len(_leaves(calls)) < 2):
        return None
    return calls[-1].call_id


def _leaves(calls: Sequence[GatewayCall]) -> set[str]:
    """The logical ids no call continues (a retry's child continues the logical call)."""
    logical_of = {call.call_id: call.logical_call_id for call in calls}
    extended = {logical_of.get(call.parent_call_id) for call in calls if call.parent_call_id is not None}
    return {call.logical_call_id for call in calls} - extended


_CHOICE = re.compile(r"\.\d+$")
_KIND_CODES = {"turns": "t", "text": "x"}
_LOGICAL = re.compile(r"^h([tx])(\d+)-([0-9a-f]{32})(?:\.\d+)?$")


def logical_call_id(history: History) -> str:
    """The same history always gets the same logical id: its retries collapse in the ledger.

    It also carries the request's digest, so a restarted gateway finds it in the log.
    """
    return f"h{_KIND_CODES[history.kind]}{history.length}-{history.digest.hex()}"


def parse_logical_call_id(text: str) -> tuple[str, int, bytes] | None:
    """(kind, request length, request digest) of a gateway-minted logical id (a choice's too)."""
    match = _LOGICAL.match(text)
    if match is None:
        return None
    kind = "turns" if match.group(1) == "t" else "text"
    return kind, int(match.group(2)), bytes.fromhex(match.group(3))


__all__ = [
    "GatewayCall",
    "Resolution",
    "episode_end",
    "left_out_replies",
    "logical_call_id",
    "parse_logical_call_id",
    "reasoning_rewrite",
    "resolve",
]
