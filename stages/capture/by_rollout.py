"""What a worker keeps per call while its rollout is in flight, found by key and by rollout.

The chain cache and the retained rows keep the same shape: entries by staging key, oldest
(or least recently used) first so that a byte budget drops the oldest, and grouped by
rollout so that a finalized rollout lets go of all of its entries at once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

V = TypeVar("V")


class ByRollout(Generic[V]):
    """Entries by key, oldest first, each of one rollout and of a size in bytes."""

    def __init__(self, rollout_of: Callable[[V], str], nbytes: Callable[[V], int]) -> None:
        self._rollout_of = rollout_of
        self._nbytes = nbytes
        self._entries: OrderedDict[str, V] = OrderedDict()
        self._keys_of: dict[str, set[str]] = {}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[V]:
        """The entries, oldest first."""
        return iter(self._entries.values())

    def get(self, key: str) -> V | None:
        return self._entries.get(key)

    def put(self, key: str, value: V) -> None:
        """Keep ``value`` as the newest entry, replacing one under the same key."""
        self.pop(key)
        self._entries[key] = value
        self._keys_of.setdefault(self._rollout_of(value), set()).add(key)
        self.nbytes += self._nbytes(value)

    def touch(self, key: str) -> None:
        """Count ``key`` as just used: the last the budget drops."""
        self._entries.move_to_end(key)

    def pop(self, key: str) -> V | None:
        value = self._entries.pop(key, None)
        if value is None:
            return None
        self.nbytes -= self._nbytes(value)
        rollout = self._rollout_of(value)
        keys = self._keys_of[rollout]
        keys.discard(key)
        if not keys:
            del self._keys_of[rollout]
        return value

    def pop_rollout(self, rollout_id: str) -> list[str]:
        """Let go of every entry of a rollout; returns their keys, sorted."""
        keys = sorted(self._keys_of.get(rollout_id, ()))
        for key in keys:
            self.pop(key)
        return keys

    def drop_oldest(self, budget_bytes: int, *, keep: int = 0) -> int:
        """Drop the oldest entries while over ``budget_bytes`` and more than ``keep`` are
        left; returns how many went."""
        dropped = 0
        while self.nbytes > budget_bytes and len(self._entries) > keep:
            self.pop(next(iter(self._entries)))
            dropped += 1
        return dropped
