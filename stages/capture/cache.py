"""Worker-local chain cache: the deltas this worker staged or resolved, bounded by bytes.

A child call usually lands on the worker that served its parent, whose row may still
be in the writer queue; the cache lets that child resolve its prefix without any
data-plane read. Entries are per call (delta ids + chain hash), so a chain costs its
token count once, not once per turn.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True, slots=True)
class ChainLink:
    """One call of a chain: its staging key, its new ids, and the chain hash through it."""

    key: str
    delta_ids: npt.NDArray[np.int64]
    chain_hash: str
    cum_len: int

    @property
    def nbytes(self) -> int:
        return int(self.delta_ids.nbytes) + 160


class ChainCache:
    """Least-recently-used links, evicted once their bytes exceed ``max_bytes``."""

    def __init__(self, max_bytes: int = 256 * 2**20) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes: must be > 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._links: OrderedDict[str, ChainLink] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._links)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def put(self, link: ChainLink) -> None:
        self.discard(link.key)
        self._links[link.key] = link
        self._bytes += link.nbytes
        while self._bytes > self.max_bytes and len(self._links) > 1:
            _, evicted = self._links.popitem(last=False)
            self._bytes -= evicted.nbytes

    def get(self, key: str) -> ChainLink | None:
        link = self._links.get(key)
        if link is not None:
            self._links.move_to_end(key)
        return link

    def discard(self, key: str) -> None:
        link = self._links.pop(key, None)
        if link is not None:
            self._bytes -= link.nbytes

    def cached_prefix(self, chain: Sequence[str]) -> list[ChainLink]:
        """The longest run of cached links from the root of ``chain``."""
        links: list[ChainLink] = []
        for key in chain:
            link = self.get(key)
            if link is None:
                break
            links.append(link)
        return links
