"""Canonical byte encodings shared by the digests (DESIGN §4.3).

Token ids and float vectors are encoded with one numpy call each; a Python loop
over tokens would cap hashing far below the engine's token rate.
"""

from __future__ import annotations

import array
import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

U64 = struct.Struct(">Q")
I64 = struct.Struct(">q")
F64 = struct.Struct(">d")

IdsLike = Sequence[int] | npt.NDArray[np.integer[Any]]
FloatsLike = Sequence[float] | npt.NDArray[np.floating[Any]]


class EncodingError(ValueError):
    """A value has no canonical encoding; ``field`` names where it came from."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def u64(value: int) -> bytes:
    return U64.pack(value)


def text(value: str) -> bytes:
    data = value.encode("utf-8")
    return U64.pack(len(data)) + data


def opt_text(value: str | None) -> bytes:
    return b"\x00" if value is None else b"\x01" + text(value)


def ids_array(values: IdsLike, field: str = "token_ids") -> npt.NDArray[np.uint64]:
    """Token ids as a big-endian u64 array; negative ids and floats are rejected.

    Python lists go through ``array.array('Q')``, which type-checks every element in C
    and is several times faster than numpy's generic list conversion.
    """
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or values.dtype.kind not in "iu":
            raise EncodingError(field, f"token ids must be a flat integer array, got {values.dtype}")
        if values.dtype.kind == "i" and values.size and int(values.min()) < 0:
            raise EncodingError(field, "token ids must be non-negative")
        return values.astype(">u8", copy=False)
    try:
        native = array.array("Q", values)
    except (TypeError, OverflowError) as exc:
        raise EncodingError(field, f"token ids must be non-negative integers ({exc})") from None
    return np.frombuffer(native, dtype=np.uint64).astype(">u8")


def ids_parts(values: IdsLike, field: str = "token_ids") -> tuple[bytes, npt.NDArray[np.uint64]]:
    """``ids(v)`` as (count header, body) so callers can hash it without a copy."""
    body = ids_array(values, field)
    return U64.pack(body.size), body


def ids(values: IdsLike, field: str = "token_ids") -> bytes:
    header, body = ids_parts(values, field)
    return header + body.tobytes()


def f32s_parts(values: FloatsLike, field: str = "values") -> tuple[bytes, npt.NDArray[np.float32]]:
    """``f32s(v)`` as (count header, big-endian float32 body) so callers can hash it without a copy."""
    is_float32 = isinstance(values, np.ndarray) and values.dtype == np.float32
    array = np.asarray(values, dtype=np.float32 if is_float32 else np.float64)  # no copy for float32
    if array.ndim != 1:
        raise EncodingError(field, "must be a flat sequence of floats")
    if array.size and not np.isfinite(array).all():
        raise EncodingError(field, "must be finite (no NaN or Inf)")
    return U64.pack(array.size), array.astype(">f4")


def f32s(values: FloatsLike, field: str = "values") -> bytes:
    header, body = f32s_parts(values, field)
    return header + body.tobytes()


def extras(value: Any, field: str = "extras") -> bytes:
    """Canonical encoding of a JSON-like value; anything else is rejected by type."""
    kind = type(value)
    if value is None:
        return b"N"
    if kind is bool:
        return b"B" + (b"\x01" if value else b"\x00")
    if kind is int:
        if not -(2**63) <= value < 2**63:
            raise EncodingError(field, f"integer {value} does not fit in i64")
        return b"I" + I64.pack(value)
    if kind is float:
        if not math.isfinite(value):
            raise EncodingError(field, "floats must be finite")
        return b"F" + F64.pack(value)
    if kind is str:
        return b"S" + text(value)
    if kind is list:
        parts = [b"L", U64.pack(len(value))]
        parts.extend(extras(item, f"{field}[{i}]") for i, item in enumerate(value))
        return b"".join(parts)
    if kind is dict:
        for key in value:
            if type(key) is not str:
                raise EncodingError(field, f"dict keys must be str, got {type(key).__name__}")
        parts = [b"D", U64.pack(len(value))]
        for key in sorted(value, key=lambda k: k.encode("utf-8")):
            parts.append(text(key))
            parts.append(extras(value[key], f"{field}.{key}"))
        return b"".join(parts)
    raise EncodingError(field, f"type {kind.__name__} is not JSON-like")
