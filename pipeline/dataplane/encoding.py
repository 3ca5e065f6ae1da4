"""Row encoding: ``StagedCall`` (or the capture path's ``StagedRow`` arrays) and
``TrainingSample`` to TransferQueue rows and back.

Rows are written in layout 2 (``packed``: the whole row as one ``uint8`` field, ``row``)
and read in layout 2 or layout 1 (``columns``: one typed field per vector), whichever
the row was written in; ``CALL_LAYOUTS`` and ``SAMPLE_LAYOUTS`` list them newest first.

float32 storage: masks and logprobs are stored as float32, so a value read back is
the float32 rounding of the value written (the digest of DESIGN §4.3 encodes them as
float32 too, so a row's digest is unchanged by the round trip). A logprob that does
not fit in float32 is refused on write rather than stored as infinity.

What decoding checks is structure (the layout's header and lengths, the ``meta``
document), never values: see ``documents``.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch
from tensordict import NonTensorStack, TensorDict

from pipeline.dataplane import columns, documents
from pipeline.dataplane.packed import (
    CALL_SECTIONS,
    INT64,
    ROW_FIELD,
    SAMPLE_SECTIONS,
    RowFormatError,
    Sections,
)
from topics.records import StagedCall, TrainingSample
from topics.staging import CallRow, row_vectors

Decode = Callable[[Sequence[str], TensorDict], list[Any]]
Record = TypeVar("Record", StagedCall, TrainingSample)

__all__ = [
    "CALL_LAYOUTS",
    "ROW_FIELD",
    "SAMPLE_LAYOUTS",
    "RowFormatError",
    "RowLayout",
    "decode_calls",
    "decode_samples",
    "encode_calls",
    "encode_samples",
]


@dataclass(frozen=True, slots=True)
class RowLayout:
    """How one generation of rows lies in TransferQueue: its fields and its reader."""

    name: str
    fields: tuple[str, ...]
    decode: Decode


# ---------------------------------------------------------------- encoding


def _ints(key: str, field: str, values: Sequence[int] | npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """int64 values; ``array('q')`` type-checks every element of a list in C (floats, overflow).

    An array comes from ``build_row``, already int64: it is used as it is.
    """
    if isinstance(values, np.ndarray):
        if values.dtype != np.int64 or values.ndim != 1:
            raise RowFormatError(key, field, f"not a flat int64 array ({values.dtype})")
        return values.astype(INT64, copy=False)
    try:
        packed = array.array("q", values)
    except (TypeError, OverflowError) as exc:
        raise RowFormatError(key, field, f"not representable as int64 ({exc})") from None
    return np.frombuffer(packed, dtype=np.int64)


def _floats(
    key: str, field: str, values: Sequence[float] | npt.NDArray[np.float32]
) -> npt.NDArray[np.float32]:
    """float32 values; values beyond float32's range would become infinities, so refuse them."""
    if isinstance(values, np.ndarray):
        if values.dtype.kind != "f" or values.ndim != 1:
            raise RowFormatError(key, field, f"not a flat float array ({values.dtype})")
        with np.errstate(over="ignore"):  # an overflow becomes Inf, refused below
            found = values.astype("<f4", copy=False)
    else:
        try:
            packed = array.array("f", values)
        except (TypeError, OverflowError) as exc:
            raise RowFormatError(key, field, f"not representable as float32 ({exc})") from None
        found = np.frombuffer(packed, dtype=np.float32)
    if not bool(np.isfinite(found).all()):
        raise RowFormatError(key, field, "values must be finite in float32 (NaN, Inf or beyond ±3.4e38)")
    return found


def _rows(blobs: list[bytes]) -> TensorDict:
    """The ``row`` column: one ``uint8`` tensor per row.

    A stack of plain tensors rather than one jagged nested tensor: TransferQueue unbinds
    a nested tensor several times per put through torch's Python-level nested dispatch.
    """
    tensors = [torch.frombuffer(bytearray(blob), dtype=torch.uint8) for blob in blobs]
    return TensorDict({ROW_FIELD: NonTensorStack(*tensors)}, batch_size=[len(blobs)])


def encode_calls(rows: Sequence[CallRow]) -> TensorDict:
    """One layout-2 row per call, in the order given; a ``StagedRow``'s arrays are used as they are."""
    if not rows:
        raise ValueError("encode_calls: no rows")
    blobs = []
    for row in rows:
        key = row.staging_key
        row_ids, row_mask, row_logprobs = row_vectors(row)
        counts = [row.prev_len, row.delta_len, row.cum_len, row.weight_version]
        blobs.append(
            CALL_SECTIONS.pack(
                [
                    _ints(key, "counts", counts),
                    _ints(key, "token_ids", row_ids),
                    _floats(key, "token_mask", row_mask),
                    _floats(key, "logprobs", row_logprobs),
                    documents.call_meta(row),
                ]
            )
        )
    return _rows(blobs)


def encode_samples(samples: Sequence[TrainingSample]) -> TensorDict:
    """One layout-2 row per sample, in the order given."""
    if not samples:
        raise ValueError("encode_samples: no samples")
    blobs = []
    for sample in samples:
        key = sample.key
        blobs.append(
            SAMPLE_SECTIONS.pack(
                [
                    _ints(key, "token_ids", sample.token_ids),
                    _ints(key, "weight_versions", sample.weight_versions),
                    _floats(key, "token_mask", sample.token_mask),
                    _floats(key, "logprobs", sample.logprobs),
                    documents.sample_meta(sample),
                ]
            )
        )
    return _rows(blobs)


# ---------------------------------------------------------------- decoding


def _decode(
    keys: Sequence[str], data: TensorDict, sections: Sections, build: Callable[..., Record]
) -> list[Record]:
    """``build(key, *vectors as lists, meta as bytes)`` for every row, in order. The
    column's bytes are copied out once for all rows."""
    found = columns.column(data, keys, ROW_FIELD, torch.uint8)
    raw, bounds = found.flat.tobytes(), found.bounds
    records = []
    for i, key in enumerate(keys):
        *vectors, meta = sections.unpack(key, raw, bounds[i], bounds[i + 1])
        records.append(build(key, *[vector.tolist() for vector in vectors], meta.tobytes()))
    return records


def decode_calls(keys: Sequence[str], data: TensorDict) -> list[StagedCall]:
    """Layout-2 call rows read for ``keys`` (in that order) as ``StagedCall`` records, unvalidated."""
    return _decode(keys, data, CALL_SECTIONS, documents.call_record)


def decode_samples(keys: Sequence[str], data: TensorDict) -> list[TrainingSample]:
    """Layout-2 sample rows read for ``keys`` (in that order) as ``TrainingSample`` records, unvalidated."""
    return _decode(keys, data, SAMPLE_SECTIONS, documents.sample_record)


CALL_LAYOUTS: tuple[RowLayout, ...] = (
    RowLayout("packed", (ROW_FIELD,), decode_calls),
    RowLayout("columns", columns.CALL_FIELDS, columns.decode_calls),
)
SAMPLE_LAYOUTS: tuple[RowLayout, ...] = (
    RowLayout("packed", (ROW_FIELD,), decode_samples),
    RowLayout("columns", columns.SAMPLE_FIELDS, columns.decode_samples),
)
