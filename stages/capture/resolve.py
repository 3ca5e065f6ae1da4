"""Prefix resolution: the exact ids of a call's ancestors, before the engine sees it.

Order of sources: the worker's chain cache, then one batched data-plane read of the
missing suffix of the chain, then a bounded wait for rows another worker is still
staging. The resolved prefix is checked against the admission's ``parent_chain_hash``
by recomputing the chain, so a tampered or mixed-up row is never used.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import anyio
import numpy as np
import numpy.typing as npt

from stages.capture.cache import ChainCache, ChainLink
from stages.capture.errors import CaptureFailure
from stages.ports import DataPlane, DataPlaneError, read_calls
from topics.digest import chain_hash
from topics.failures import WorkerFailure
from topics.records import CaptureAdmission, StagedCall


@dataclass(frozen=True, slots=True)
class ResolvedPrefix:
    """The parent's cumulative ids and chain hash, verified."""

    ids: npt.NDArray[np.int64]
    chain_hash: str


class PrefixResolver:
    """Resolves admissions to exact prefixes; ``wait_s`` bounds the wait for late rows."""

    def __init__(
        self, data_plane: DataPlane, cache: ChainCache, *, wait_s: float = 5.0, poll_s: float = 0.02
    ) -> None:
        self.data_plane = data_plane
        self.cache = cache
        self.wait_s = wait_s
        self.poll_s = poll_s

    async def resolve(self, admission: CaptureAdmission) -> ResolvedPrefix | None:
        """None for a root call; raises ``CaptureFailure`` when the prefix cannot be trusted."""
        if admission.staging_chain is None or admission.parent_chain_hash is None:
            return None
        links = await self._links(admission.staging_chain)
        if links[-1].chain_hash != admission.parent_chain_hash:
            raise CaptureFailure(
                WorkerFailure.PREFIX_HASH_MISMATCH,
                f"chain through {links[-1].key} does not match the admission",
            )
        ids = np.concatenate([link.delta_ids for link in links])
        if ids.size != admission.prev_len:
            raise CaptureFailure(
                WorkerFailure.PREFIX_HASH_MISMATCH,
                f"prefix has {ids.size} ids, admission says {admission.prev_len}",
            )
        return ResolvedPrefix(ids, links[-1].chain_hash)

    async def _links(self, chain: Sequence[str]) -> list[ChainLink]:
        deadline = time.monotonic() + self.wait_s
        links = self.cache.cached_prefix(chain)
        while len(links) < len(chain):
            missing = list(chain[len(links) :])
            links += self._verified(links, missing, await self._fetch_available(missing))
            if len(links) == len(chain):
                break
            if time.monotonic() >= deadline:
                raise CaptureFailure(
                    WorkerFailure.PREFIX_UNAVAILABLE,
                    f"ancestor row {chain[len(links)]} not staged within {self.wait_s}s",
                )
            await anyio.sleep(self.poll_s)
            # Verified rows are cached, and so are rows this worker's own hook staged meanwhile.
            links = self.cache.cached_prefix(chain)
        return links

    async def _fetch_available(self, keys: list[str]) -> dict[str, StagedCall]:
        """The rows readable now; the chain is verified up to the first one missing."""
        try:
            rows, _ = await read_calls(self.data_plane, keys)
            return rows
        except DataPlaneError as exc:
            raise CaptureFailure(WorkerFailure.PREFIX_UNAVAILABLE, f"data plane: {exc}") from None

    def _verified(
        self, links: list[ChainLink], keys: list[str], rows: dict[str, StagedCall]
    ) -> list[ChainLink]:
        """Extend ``links`` with fetched rows in chain order, recomputing every chain hash."""
        parent_hash = links[-1].chain_hash if links else None
        length = links[-1].cum_len if links else 0
        added: list[ChainLink] = []
        for key in keys:
            row = rows.get(key)
            if row is None:
                break
            if row.staging_key != key:
                raise CaptureFailure(
                    WorkerFailure.PREFIX_HASH_MISMATCH, f"row under {key} is {row.staging_key}"
                )
            if row.prev_len != length or row.delta_len != len(row.token_ids_delta):
                raise CaptureFailure(
                    WorkerFailure.PREFIX_HASH_MISMATCH, f"row {key} has inconsistent lengths"
                )
            delta = np.asarray(row.token_ids_delta, dtype=np.int64)
            recomputed = chain_hash(parent_hash, delta)
            if recomputed != row.chain_hash:
                raise CaptureFailure(WorkerFailure.PREFIX_HASH_MISMATCH, f"row {key} fails its chain hash")
            link = ChainLink(key, delta, recomputed, length + delta.size)
            self.cache.put(link)
            added.append(link)
            parent_hash, length = recomputed, link.cum_len
        return added
