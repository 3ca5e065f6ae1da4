"""Worker-local chain cache: the deltas this worker staged or resolved, bounded by bytes.

A child call usually lands on the worker that served its parent, whose row may still
be in the writer queue; the cache lets that child resolve its prefix without any
data-plane read. Entries are per call (delta ids + chain hash), so a chain costs its
token count once, not once per turn.

A finalized rollout takes no more calls, so its links are forgotten then
(``forget_rollout``): the cache holds the rollouts in flight, not every rollout the
worker ever served until the byte bound (hours of a long run) is reached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from stages.capture.by_rollout import ByRollout


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

    @property
    def rollout_id(self) -> str:
        """The rollout of the call (a staging key is ``{rollout_id}/{call_id}``; ids hold no ``/``)."""
        return self.key.partition("/")[0]


class ChainCache:
    """Least-recently-used links, evicted once their bytes exceed ``max_bytes``."""

    def __init__(self, max_bytes: int = 256 * 2**20) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes: must be > 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._links: ByRollout[ChainLink] = ByRollout(lambda link: link.rollout_id, lambda link: link.nbytes)

    def __len__(self) -> int:
        return len(self._links)

    @property
    def nbytes(self) -> int:
        return self._links.nbytes

    def put(self, link: ChainLink) -> None:
        self._links.put(link.key, link)
        self._links.drop_oldest(self.max_bytes, keep=1)

    def get(self, key: str) -> ChainLink | None:
        link = self._links.get(key)
        if link is not None:
            self._links.touch(key)
        return link

    def discard(self, key: str) -> None:
        self._links.pop(key)

    def forget_rollout(self, rollout_id: str) -> None:
        """Drop every link of a rollout that takes no more calls (it was finalized)."""
        self._links.pop_rollout(rollout_id)

    def cached_prefix(self, chain: Sequence[str]) -> list[ChainLink]:
        """The longest run of cached links from the root of ``chain``."""
        links: list[ChainLink] = []
        for key in chain:
            link = self.get(key)
            if link is None:
                break
            links.append(link)
        return links
