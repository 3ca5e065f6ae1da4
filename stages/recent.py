"""A bounded set of recent ids: how stages recognise input they have already answered."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

DEFAULT_REMEMBER = 100_000
"""Rollouts a stage remembers as answered; about 100 bytes each."""


class RecentIds:
    """The last ``capacity`` distinct ids added; the oldest is forgotten first."""

    def __init__(self, capacity: int = DEFAULT_REMEMBER) -> None:
        if capacity < 0:
            raise ValueError(f"capacity: must be >= 0, got {capacity}")
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, item: str) -> None:
        self._ids[item] = None
        self._ids.move_to_end(item)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def update(self, items: Iterable[str]) -> None:
        for item in items:
            self.add(item)

    def discard(self, item: str) -> None:
        self._ids.pop(item, None)

    def __contains__(self, item: object) -> bool:
        return item in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self) -> Iterator[str]:
        """Oldest first: ``update`` with them rebuilds the same set, forgetting in the same order."""
        return iter(self._ids)
