"""A chain's rows as one array per vector field, checked and made canonical once.

Verifying row by row cost a dozen numpy calls per row on arrays of a few dozen values,
so the calls, not the values, were the cost. Here each field of the whole chain is one
array; the mask rules, the finiteness and sign checks and the big-endian forms the
digests hash (DESIGN §4.3) are computed once, and a row's checks read its results by
index. A row's canonical bytes are a slice of the chain's, so its digest is the same.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from topics.records import StagedCall


def _flat(rows: Sequence[StagedCall], field: str, dtype: type[np.generic], total: int) -> npt.NDArray[Any]:
    values = itertools.chain.from_iterable(getattr(row, field) for row in rows)
    return np.fromiter(values, dtype=dtype, count=total)


def _per_row(flags: npt.NDArray[Any], bounds: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """How many of ``flags`` are set in each row (rows may be empty)."""
    running = np.concatenate(([0], np.cumsum(flags, dtype=np.int64)))
    result: npt.NDArray[np.int64] = running[bounds[1:]] - running[bounds[:-1]]
    return result


@dataclass(frozen=True, slots=True)
class ChainVectors:
    """Ids, mask and logprobs of a chain's rows, end to end, with per-row check results.

    Built from rows whose vectors agree in length (the lengths check comes first);
    raises ``TypeError``, ``ValueError`` or ``OverflowError`` for a value no row of the
    data plane's dtypes can hold.
    """

    bounds: npt.NDArray[np.int64]
    ids: npt.NDArray[np.int64]
    mask: npt.NDArray[np.float64]
    logprobs: npt.NDArray[np.float64]
    ids_canonical: npt.NDArray[np.uint64]
    """Big-endian u64 (meaningful for rows without negative ids)."""
    mask_canonical: npt.NDArray[np.float32]
    logprobs_canonical: npt.NDArray[np.float32]
    stray_mask: npt.NDArray[np.int64]
    """Per row: mask values other than 0.0 and 1.0."""
    generated: npt.NDArray[np.int64]
    """Per row: mask ones (generated tokens)."""
    out_of_order: npt.NDArray[np.int64]
    """Per row: positions where the mask is not zeros then ones."""
    negative_ids: npt.NDArray[np.int64]
    not_finite: npt.NDArray[np.int64]
    """Per row: NaN or infinite mask values and logprobs."""

    @classmethod
    def of(cls, rows: Sequence[StagedCall]) -> ChainVectors:
        lengths = np.fromiter((len(row.token_ids_delta) for row in rows), dtype=np.int64, count=len(rows))
        bounds = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        total = int(bounds[-1])
        ids = _flat(rows, "token_ids_delta", np.int64, total)
        mask = _flat(rows, "token_mask_delta", np.float64, total)
        logprobs = _flat(rows, "logprobs_delta", np.float64, total)
        ones = mask == 1.0
        generated = _per_row(ones, bounds)
        carry = lengths - generated
        place = np.arange(total) - np.repeat(bounds[:-1], lengths)  # each value's index in its row
        with np.errstate(over="ignore"):  # beyond float32's range: infinite, as the digest encodes it
            mask_canonical = mask.astype(">f4")
            logprobs_canonical = logprobs.astype(">f4")
        return cls(
            bounds=bounds,
            ids=ids,
            mask=mask,
            logprobs=logprobs,
            ids_canonical=ids.astype(">u8"),
            mask_canonical=mask_canonical,
            logprobs_canonical=logprobs_canonical,
            stray_mask=_per_row(~(ones | (mask == 0.0)), bounds),
            generated=generated,
            out_of_order=_per_row(ones != (place >= np.repeat(carry, lengths)), bounds),
            negative_ids=_per_row(ids < 0, bounds),
            not_finite=_per_row(~(np.isfinite(mask) & np.isfinite(logprobs)), bounds),
        )

    def span(self, row: int) -> slice:
        return slice(int(self.bounds[row]), int(self.bounds[row + 1]))

    def carry(self, row: int) -> int:
        """The row's carried (mask 0) tokens."""
        return int(self.bounds[row + 1] - self.bounds[row] - self.generated[row])
