"""Reading TransferQueue columns, and row layout 1: one typed field per vector.

Layout 1 is what releases before row layout 2 (``packed``) wrote, and a data plane that
outlives an upgrade may still hold such rows, so readers keep reading it:

=====================  =======  ===============================================
field                  dtype    per row
=====================  =======  ===============================================
``token_ids``          int64    token ids (the delta of a call, all of a sample)
``token_mask``         float32  the loss mask
``logprobs``           float32  the log-probabilities
``counts``             int64    calls: prev_len, delta_len, cum_len, weight_version
``weight_versions``    int64    samples: the policy version of every token
``meta``               uint8    UTF-8 JSON: identity, hashes, extras or spans
=====================  =======  ===============================================
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy.typing as npt
import torch
from tensordict import TensorDict

from pipeline.dataplane import documents
from pipeline.dataplane.packed import RowFormatError
from topics.records import StagedCall, TrainingSample

CALL_FIELDS = documents.CALL_PARTS
SAMPLE_FIELDS = documents.SAMPLE_PARTS
FIELD_DTYPES: dict[str, torch.dtype] = {
    "token_ids": torch.int64,
    "token_mask": torch.float32,
    "logprobs": torch.float32,
    "counts": torch.int64,
    "weight_versions": torch.int64,
    "meta": torch.uint8,
}


@dataclass(frozen=True, slots=True)
class Column:
    """One field's rows as one flat array and each row's bounds in it.

    TransferQueue returns a column as a jagged nested tensor: its values are one buffer
    already, so rows are read from that buffer as a whole (one ``tolist`` or one
    ``tobytes`` per column) and cut by offsets, instead of one tensor slice and one
    conversion per row.
    """

    flat: npt.NDArray[Any]
    bounds: list[int]

    def lists(self) -> list[list[Any]]:
        """Each row as a Python list (ints or floats)."""
        values = self.flat.tolist()
        return [values[start:end] for start, end in itertools.pairwise(self.bounds)]

    def blobs(self) -> list[bytes]:
        """Each row's bytes (a ``uint8`` field)."""
        raw = self.flat.tobytes()
        return [raw[start:end] for start, end in itertools.pairwise(self.bounds)]


def column(data: TensorDict, keys: Sequence[str], field: str, expected: torch.dtype) -> Column:
    """The rows of ``field``, checked for dtype and rank.

    TransferQueue hands a column back as a jagged nested tensor when every row agrees in
    dtype and rank (a dense one when they also agree in length); when they do not it
    falls back to a *strided* nested tensor that silently casts them, so that layout is
    itself the sign of a bad row (which one is not knowable from the batch).
    """
    value: Any = data.get(field, None)
    if value is None:
        raise RowFormatError(keys[0] if len(keys) == 1 else None, field, "missing from the rows read")
    whole = keys[0] if len(keys) == 1 else None  # whom a whole-column problem concerns
    if isinstance(value, torch.Tensor):
        if value.is_nested and value.layout != torch.jagged:
            raise RowFormatError(
                whole, field, "rows disagree in dtype or rank (TransferQueue cast them to one dtype)"
            )
        if value.dim() != 2:
            raise RowFormatError(whole, field, f"rows of rank {value.dim() - 1}, expected one dimension")
        if value.dtype != expected:
            raise RowFormatError(whole, field, f"dtype {value.dtype}, expected {expected}")
        if value.is_nested:
            jagged: Any = value  # torch's NestedTensor; its stubs are the plain Tensor's
            found = Column(jagged.values().numpy(), jagged.offsets().tolist())
        else:
            rows, width = value.shape
            found = Column(value.contiguous().reshape(-1).numpy(), list(range(0, rows * width + 1, width)))
        if len(found.bounds) - 1 != len(keys):
            raise RowFormatError(whole, field, f"{len(found.bounds) - 1} values for {len(keys)} keys")
        return found
    # A NonTensorStack (or a list): per-row tensors, a row lacking this field as None.
    parts = list(value.tolist()) if hasattr(value, "tolist") else list(value)
    if len(parts) != len(keys):
        raise RowFormatError(whole, field, f"{len(parts)} values for {len(keys)} keys")
    for key, part in zip(keys, parts, strict=True):
        if part is None:
            raise RowFormatError(key, field, "missing")
        if not isinstance(part, torch.Tensor):
            raise RowFormatError(key, field, f"expected a tensor, got {type(part).__name__}")
        if part.dtype != expected:
            raise RowFormatError(key, field, f"dtype {part.dtype}, expected {expected}")
        if part.dim() != 1:
            raise RowFormatError(key, field, f"shape {tuple(part.shape)}, expected one dimension")
    bounds = [0, *itertools.accumulate(int(part.shape[0]) for part in parts)]
    flat = (torch.cat(parts) if parts else torch.zeros(0, dtype=expected)).numpy()
    return Column(flat, bounds)


def _parts(data: TensorDict, keys: Sequence[str], fields: Sequence[str]) -> list[tuple[Any, ...]]:
    """Each row's parts in ``fields`` order: the vectors as lists, ``meta`` (last) as
    bytes. Every column is checked before any row is built."""
    *vectors, meta = (column(data, keys, name, FIELD_DTYPES[name]) for name in fields)
    return list(zip(*(c.lists() for c in vectors), meta.blobs(), strict=True))


def decode_calls(keys: Sequence[str], data: TensorDict) -> list[StagedCall]:
    """Layout-1 call rows read for ``keys`` (in that order), unvalidated."""
    parts = _parts(data, keys, CALL_FIELDS)
    return [documents.call_record(key, *row) for key, row in zip(keys, parts, strict=True)]


def decode_samples(keys: Sequence[str], data: TensorDict) -> list[TrainingSample]:
    """Layout-1 sample rows read for ``keys`` (in that order), unvalidated."""
    parts = _parts(data, keys, SAMPLE_FIELDS)
    return [documents.sample_record(key, *row) for key, row in zip(keys, parts, strict=True)]
