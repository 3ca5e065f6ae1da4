"""Row encoding: ``StagedCall`` (or the capture path's ``StagedRow`` arrays) and
``TrainingSample`` to TransferQueue fields and back.

Every field has one fixed dtype, so a reader can tell a foreign or corrupted row from
a good one instead of letting TransferQueue silently cast it:

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

Variable-length fields travel as stacks of per-row tensors; TransferQueue returns
them as jagged nested tensors.

float32 storage: masks and logprobs are stored as float32, so a value read back is
the float32 rounding of the value written (the digest of DESIGN §4.3 encodes them as
float32 too, so a row's digest is unchanged by the round trip). A logprob that does
not fit in float32 is refused on write rather than stored as infinity.

Decoding builds records with ``assemble`` (the record ``model_construct`` builds, for
less) from correctly typed Python values and does *not* re-run the §4.2 rules, so a
verifier downstream can map each corruption to its own failure code. What it does check is structure: every field present, with its
dtype and rank, and a ``meta`` document with the expected keys and JSON types. A row
that fails is reported by ``RowFormatError`` naming the key and the field.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson
import torch
from tensordict import NonTensorStack, TensorDict

from topics import canonical
from topics.records import CallSpan, StagedCall, TrainingSample, assemble
from topics.staging import CallRow, row_vectors

CALL_FIELDS: tuple[str, ...] = ("token_ids", "token_mask", "logprobs", "counts", "meta")
SAMPLE_FIELDS: tuple[str, ...] = ("token_ids", "token_mask", "logprobs", "weight_versions", "meta")
FIELD_DTYPES: dict[str, torch.dtype] = {
    "token_ids": torch.int64,
    "token_mask": torch.float32,
    "logprobs": torch.float32,
    "counts": torch.int64,
    "weight_versions": torch.int64,
    "meta": torch.uint8,
}
COUNTS: tuple[str, ...] = ("prev_len", "delta_len", "cum_len", "weight_version")

_STR = (str,)
_OPT_STR = (str, type(None))


class RowFormatError(ValueError):
    """A row that cannot be encoded or decoded; ``key`` is None for a whole-batch problem."""

    def __init__(self, key: str | None, field: str, reason: str) -> None:
        where = f"row {key!r}, field {field!r}" if key is not None else f"field {field!r}"
        super().__init__(f"{where}: {reason}")
        self.key = key
        self.field = field
        self.reason = reason


# ---------------------------------------------------------------- encoding


def _ints(key: str, field: str, values: Sequence[int] | npt.NDArray[np.int64]) -> torch.Tensor:
    """int64 tensor; ``array('q')`` type-checks every element of a list in C (floats, overflow).

    An array comes from ``build_row``, already int64: it is wrapped, not copied.
    """
    if isinstance(values, np.ndarray):
        if values.dtype != np.int64 or values.ndim != 1:
            raise RowFormatError(key, field, f"not a flat int64 array ({values.dtype})")
        return torch.from_numpy(np.ascontiguousarray(values))
    try:
        packed = array.array("q", values)
    except (TypeError, OverflowError) as exc:
        raise RowFormatError(key, field, f"not representable as int64 ({exc})") from None
    return _from_array(packed, torch.int64)


def _floats(key: str, field: str, values: Sequence[float] | npt.NDArray[np.float32]) -> torch.Tensor:
    """float32 tensor; values beyond float32's range would become infinities, so refuse them."""
    if isinstance(values, np.ndarray):
        if values.dtype.kind != "f" or values.ndim != 1:
            raise RowFormatError(key, field, f"not a flat float array ({values.dtype})")
        with np.errstate(over="ignore"):  # an overflow becomes Inf, refused below
            tensor = torch.from_numpy(values.astype(np.float32, copy=False))
    else:
        try:
            packed = array.array("f", values)
        except (TypeError, OverflowError) as exc:
            raise RowFormatError(key, field, f"not representable as float32 ({exc})") from None
        tensor = _from_array(packed, torch.float32)
    if not bool(torch.isfinite(tensor).all()):
        raise RowFormatError(key, field, "values must be finite in float32 (NaN, Inf or beyond ±3.4e38)")
    return tensor


def _from_array(packed: array.array[Any], dtype: torch.dtype) -> torch.Tensor:
    if len(packed) == 0:
        return torch.zeros(0, dtype=dtype)
    return torch.frombuffer(packed, dtype=dtype)


def _meta(key: str, document: dict[str, Any]) -> torch.Tensor:
    try:
        blob = orjson.dumps(document)
    except TypeError as exc:
        raise RowFormatError(key, "meta", f"not JSON-encodable ({exc})") from None
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def _check_extras(key: str, extras: Any) -> None:
    """Only canonical extras survive JSON unchanged (no tuples, NaN, bytes, >64-bit ints)."""
    try:
        canonical.extras(extras)
    except canonical.EncodingError as exc:
        raise RowFormatError(key, "extras", str(exc)) from None


def _per_row(parts: list[torch.Tensor]) -> NonTensorStack:
    """A column of variable-length rows, as TransferQueue moves it cheapest.

    A jagged nested tensor would say the same, but TransferQueue unbinds one several
    times per put through torch's Python-level nested dispatch; a stack of plain
    tensors halves the cost of a put. The rows still travel and are stored as tensors.
    """
    return NonTensorStack(*parts)


def encode_calls(rows: Sequence[CallRow]) -> TensorDict:
    """One TensorDict row per call, in the order given; a ``StagedRow``'s arrays are used as they are."""
    if not rows:
        raise ValueError("encode_calls: no rows")
    ids: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    logprobs: list[torch.Tensor] = []
    metas: list[torch.Tensor] = []
    counts: list[torch.Tensor] = []
    for row in rows:
        key = row.staging_key
        row_ids, row_mask, row_logprobs = row_vectors(row)
        ids.append(_ints(key, "token_ids", row_ids))
        masks.append(_floats(key, "token_mask", row_mask))
        logprobs.append(_floats(key, "logprobs", row_logprobs))
        counts.append(_ints(key, "counts", [row.prev_len, row.delta_len, row.cum_len, row.weight_version]))
        _check_extras(key, row.extras)
        metas.append(
            _meta(
                key,
                {
                    "schema_version": row.schema_version,
                    "rollout_id": row.rollout_id,
                    "call_id": row.call_id,
                    "parent_call_id": row.parent_call_id,
                    "mode": row.mode,
                    "extras": row.extras,
                    "extras_digest": row.extras_digest,
                    "chain_hash": row.chain_hash,
                    "cumulative_hash": row.cumulative_hash,
                    "digest": row.digest,
                },
            )
        )
    return TensorDict(
        {
            "token_ids": _per_row(ids),
            "token_mask": _per_row(masks),
            "logprobs": _per_row(logprobs),
            "counts": torch.stack(counts),
            "meta": _per_row(metas),
        },
        batch_size=[len(rows)],
    )


def encode_samples(samples: Sequence[TrainingSample]) -> TensorDict:
    """One TensorDict row per sample, in the order given."""
    if not samples:
        raise ValueError("encode_samples: no samples")
    columns: dict[str, list[torch.Tensor]] = {name: [] for name in SAMPLE_FIELDS}
    for sample in samples:
        key = sample.key
        columns["token_ids"].append(_ints(key, "token_ids", sample.token_ids))
        columns["token_mask"].append(_floats(key, "token_mask", sample.token_mask))
        columns["logprobs"].append(_floats(key, "logprobs", sample.logprobs))
        columns["weight_versions"].append(_ints(key, "weight_versions", sample.weight_versions))
        columns["meta"].append(
            _meta(
                key,
                {
                    "schema_version": sample.schema_version,
                    "rollout_id": sample.rollout_id,
                    "group_id": sample.group_id,
                    "reward": sample.reward,
                    "cumulative_hash": sample.cumulative_hash,
                    "spans": [
                        {
                            "call_id": span.call_id,
                            "start": span.start,
                            "carry_len": span.carry_len,
                            "gen_len": span.gen_len,
                            **({"reward": span.reward} if span.reward is not None else {}),
                        }
                        for span in sample.spans
                    ],
                    # Only a sample that is one of several has its own key: the others
                    # stay byte for byte what older readers know.
                    **({"sample_key": sample.sample_key} if sample.sample_key is not None else {}),
                },
            )
        )
    return TensorDict({name: _per_row(parts) for name, parts in columns.items()}, batch_size=[len(samples)])


# ---------------------------------------------------------------- decoding


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


def column(data: TensorDict, keys: Sequence[str], field: str) -> Column:
    """The rows of ``field``, checked for dtype and rank.

    TransferQueue hands a column back as a jagged nested tensor when every row agrees in
    dtype and rank (a dense one when they also agree in length); when they do not it
    falls back to a *strided* nested tensor that silently casts them, so that layout is
    itself the sign of a bad row (which one is not knowable from the batch).
    """
    value: Any = data.get(field, None)
    if value is None:
        raise RowFormatError(keys[0] if len(keys) == 1 else None, field, "missing from the rows read")
    expected = FIELD_DTYPES[field]
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


def _document(key: str, blob: bytes) -> dict[str, Any]:
    try:
        document = orjson.loads(blob)
    except orjson.JSONDecodeError as exc:
        raise RowFormatError(key, "meta", f"not JSON ({exc})") from None
    if not isinstance(document, dict):
        raise RowFormatError(key, "meta", f"expected a JSON object, got {type(document).__name__}")
    return document


def _take(key: str, document: dict[str, Any], name: str, types: tuple[type, ...]) -> Any:
    """``document[name]`` if present with one of ``types`` (bool is not an int here)."""
    if name not in document:
        raise RowFormatError(key, f"meta.{name}", "missing")
    value = document[name]
    if type(value) not in types:
        wanted = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise RowFormatError(key, f"meta.{name}", f"expected {wanted}, got {type(value).__name__}")
    return value


def decode_calls(keys: Sequence[str], data: TensorDict) -> list[StagedCall]:
    """Rows read for ``keys`` (in that order) as ``StagedCall`` records, unvalidated."""
    ids, masks, logprobs, counts = (column(data, keys, name).lists() for name in CALL_FIELDS[:4])
    metas = column(data, keys, "meta").blobs()
    rows: list[StagedCall] = []
    for i, key in enumerate(keys):
        count = counts[i]
        if len(count) != len(COUNTS):
            raise RowFormatError(
                key, "counts", f"{len(count)} values, expected {len(COUNTS)} ({', '.join(COUNTS)})"
            )
        document = _document(key, metas[i])
        rows.append(
            assemble(
                StagedCall,
                {
                    "schema_version": _take(key, document, "schema_version", (int,)),
                    "rollout_id": _take(key, document, "rollout_id", _STR),
                    "call_id": _take(key, document, "call_id", _STR),
                    "parent_call_id": _take(key, document, "parent_call_id", _OPT_STR),
                    "mode": _take(key, document, "mode", _STR),
                    "prev_len": count[0],
                    "delta_len": count[1],
                    "cum_len": count[2],
                    "weight_version": count[3],
                    "token_ids_delta": ids[i],
                    "token_mask_delta": masks[i],
                    "logprobs_delta": logprobs[i],
                    "extras": _take(key, document, "extras", (dict, type(None))),
                    "extras_digest": _take(key, document, "extras_digest", _STR),
                    "chain_hash": _take(key, document, "chain_hash", _STR),
                    "cumulative_hash": _take(key, document, "cumulative_hash", _STR),
                    "digest": _take(key, document, "digest", _STR),
                },
            )
        )
    return rows


def _spans(key: str, raw: list[Any], schema_version: Any) -> list[CallSpan]:
    spans: list[CallSpan] = []
    for j, item in enumerate(raw):
        if not isinstance(item, dict):
            raise RowFormatError(key, f"meta.spans[{j}]", f"expected an object, got {type(item).__name__}")
        spans.append(
            assemble(
                CallSpan,
                {
                    "schema_version": schema_version,
                    "call_id": _take(key, item, "call_id", _STR),
                    "start": _take(key, item, "start", (int,)),
                    "carry_len": _take(key, item, "carry_len", (int,)),
                    "gen_len": _take(key, item, "gen_len", (int,)),
                    "reward": _take(key, item, "reward", (float, int)) if "reward" in item else None,
                },
            )
        )
    return spans


def decode_samples(keys: Sequence[str], data: TensorDict) -> list[TrainingSample]:
    """Samples read for ``keys`` (in that order) as ``TrainingSample`` records, unvalidated."""
    ids, masks, logprobs, versions = (column(data, keys, name).lists() for name in SAMPLE_FIELDS[:4])
    metas = column(data, keys, "meta").blobs()
    samples: list[TrainingSample] = []
    for i, key in enumerate(keys):
        document = _document(key, metas[i])
        schema_version = _take(key, document, "schema_version", (int,))
        samples.append(
            assemble(
                TrainingSample,
                {
                    "schema_version": schema_version,
                    "rollout_id": _take(key, document, "rollout_id", _STR),
                    "group_id": _take(key, document, "group_id", _OPT_STR),
                    "token_ids": ids[i],
                    "token_mask": masks[i],
                    "logprobs": logprobs[i],
                    "weight_versions": versions[i],
                    "spans": _spans(key, _take(key, document, "spans", (list,)), schema_version),
                    "reward": _take(key, document, "reward", (float, type(None))),
                    "cumulative_hash": _take(key, document, "cumulative_hash", _STR),
                    "sample_key": _take(key, document, "sample_key", _STR)
                    if "sample_key" in document
                    else None,
                },
            )
        )
    return samples
