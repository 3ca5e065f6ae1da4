"""A request's history as lineage compares it: digests over its canonical turns, or its text.

Each protocol turns its request into canonical turns (``pipeline.api.protocols.turns``
holds the rules) or, for Completions, the prompt text. The turns are digested as a chain,
starting from the request's template variables, so every prefix has a digest and any
prefix is matched by one lookup; a text history is compared by character prefix.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from pipeline.api.protocols import Protocol
from pipeline.api.protocols.turns import Turn, malformed

_DIGEST_SIZE = 16
_EMPTY_HISTORY = hashlib.blake2b(b"tokentrail-history", digest_size=_DIGEST_SIZE).digest()
_TEXT_PERSON = b"tokentrail-text"
_KWARGS_PERSON = b"tt-template-args"
TEMPLATE_KWARGS = "chat_template_kwargs"


def extend(digest: bytes, turn: Turn) -> bytes:
    """The digest of a history one turn longer: each digest commits to every turn before it."""
    return hashlib.blake2b(digest + turn.canonical(), digest_size=_DIGEST_SIZE).digest()


def turn_digests(turns: Sequence[Turn], start: bytes = _EMPTY_HISTORY) -> list[bytes]:
    """Element k identifies the first k turns, so any prefix is matched by one lookup;
    ``start`` is the empty history's digest (``template_start``)."""
    digests = [start]
    for turn in turns:
        digests.append(extend(digests[-1], turn))
    return digests


def template_start(body: Mapping[str, Any]) -> bytes:
    """The empty history's digest under the request's ``chat_template_kwargs``: a history
    rendered with other template variables (thinking switched off, ...) shares no prefix
    with this one, so a call that changes them starts a new root (DESIGN §13)."""
    kwargs = body.get(TEMPLATE_KWARGS)
    if kwargs is None or kwargs == {}:
        return _EMPTY_HISTORY
    if not isinstance(kwargs, Mapping):
        raise malformed(TEMPLATE_KWARGS, "must be an object")
    canonical = orjson.dumps(kwargs, option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(
        _EMPTY_HISTORY + canonical, digest_size=_DIGEST_SIZE, person=_KWARGS_PERSON
    ).digest()


def text_digest(text: str) -> bytes:
    """A completions history: its text, personalized apart from turn digests so kinds never collide."""
    data = text.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=_DIGEST_SIZE, person=_TEXT_PERSON).digest()


@dataclass(frozen=True, slots=True)
class History:
    """A request's history as lineage compares it: its length and the digest of any prefix."""

    kind: Literal["turns", "text"]
    length: int
    digests: tuple[bytes, ...] = ()
    text: str | None = None
    roles: tuple[str, ...] = ()
    """Each turn's role (turn histories): a recovered parent is found by a role, not a digest."""
    reasoning: tuple[str, ...] = ()
    """Each turn's ``Turn.reasoning``: how the agent sent reasoning back, for the rewrite counts."""
    sources: tuple[int, ...] = ()
    """Each turn's ``Turn.source``: where a left-out reply goes back into the request."""

    def __post_init__(self) -> None:
        if self.kind == "turns" and len(self.digests) != self.length + 1:
            raise ValueError(f"a history of {self.length} turns needs {self.length + 1} digests")
        if self.kind == "text" and (self.text is None or len(self.text) != self.length):
            raise ValueError(f"a text history of length {self.length} needs its text")

    def prefix_digest(self, length: int) -> bytes | None:
        """The digest of the first ``length`` turns (or characters); None past the end."""
        if not 0 <= length <= self.length:
            return None
        if self.kind == "turns":
            return self.digests[length]
        return text_digest((self.text or "")[:length])

    def role(self, index: int) -> str | None:
        """The role of turn ``index``, if there is such a turn."""
        return self.roles[index] if 0 <= index < len(self.roles) else None

    @property
    def start(self) -> bytes | None:
        """The empty history's digest (turn histories): it differs with the template variables."""
        return self.digests[0] if self.kind == "turns" else None

    @property
    def digest(self) -> bytes:
        """The digest of the whole history."""
        if self.kind == "turns":
            return self.digests[self.length]
        return text_digest(self.text or "")


def history_of(protocol: Protocol, body: Mapping[str, Any]) -> History:
    """A request's history as lineage compares it: its protocol's turns, digested, or its text."""
    given = protocol.history(body)
    if isinstance(given, str):
        return History("text", len(given), (), given)
    digests = turn_digests(given, template_start(body))
    return History(
        "turns",
        len(given),
        tuple(digests),
        roles=tuple(turn.role for turn in given),
        reasoning=tuple(turn.reasoning for turn in given),
        sources=tuple(turn.source for turn in given),
    )


def extended(history: History, reply: Turn) -> tuple[int, bytes]:
    """(length, digest) of the history followed by the reply: what a continuing request starts with."""
    if history.kind == "turns":
        return history.length + 1, extend(history.digest, reply)
    text = (history.text or "") + reply.text
    return len(text), text_digest(text)


__all__ = [
    "History",
    "extend",
    "extended",
    "history_of",
    "text_digest",
    "turn_digests",
]
