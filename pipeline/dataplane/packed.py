"""Row layout 2: a whole row as one ``uint8`` TransferQueue field.

TransferQueue's client pays per field and per key: the controller's metadata answer
(pickled, one entry per field of every key) and one nested tensor per field on read.
Five typed fields a row cost the finalizer about a third of its batch work, so a row
now travels as one byte string whose header says how long each section is:

==========  =====================================================================
bytes       content
==========  =====================================================================
0–3         magic: ``TTC2`` (a call row) or ``TTS2`` (a sample row)
4 …         one little-endian ``uint32`` per section: its element count
(padding)   zeros up to a multiple of 8 bytes
sections    in the layout's order, each little-endian in its fixed dtype, back to back
==========  =====================================================================

The 8-byte sections come first, so every int64 section starts aligned. A row whose
magic, header or length disagree is reported by ``RowFormatError`` naming the key and
the section; values are not checked here (the verifier maps each bad value to its own
failure code).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

ROW_FIELD = "row"
"""The one TransferQueue field of a layout-2 row."""


class RowFormatError(ValueError):
    """A row that cannot be encoded or decoded; ``key`` is None for a whole-batch problem."""

    def __init__(self, key: str | None, field: str, reason: str) -> None:
        where = f"row {key!r}, field {field!r}" if key is not None else f"field {field!r}"
        super().__init__(f"{where}: {reason}")
        self.key = key
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class Sections:
    """The sections of one kind of row: the magic that names it and each section's dtype."""

    magic: bytes
    dtypes: tuple[tuple[str, np.dtype[Any]], ...]
    header: struct.Struct = field(init=False)

    def __post_init__(self) -> None:
        sizes = [dtype.itemsize for _, dtype in self.dtypes]
        if sizes != sorted(sizes, reverse=True):
            raise ValueError("sections: widest dtype first, so every section starts aligned")
        count = len(self.dtypes)
        padding = -(4 + 4 * count) % 8
        object.__setattr__(self, "header", struct.Struct(f"<4s{count}I{padding}x"))

    def pack(self, parts: Sequence[npt.NDArray[Any] | bytes]) -> bytes:
        """One row's bytes; each part already in its section's dtype (or ``bytes`` for uint8)."""
        counts = [len(part) for part in parts]
        return b"".join([self.header.pack(self.magic, *counts), *(_raw(part) for part in parts)])

    def unpack(self, key: str, raw: bytes, start: int, end: int) -> list[npt.NDArray[Any]]:
        """The sections of the row at ``raw[start:end]``, as arrays viewing ``raw``."""
        header = self.header
        if end - start < header.size:
            raise RowFormatError(
                key, ROW_FIELD, f"{end - start} bytes, shorter than its {header.size}-byte header"
            )
        magic, *counts = header.unpack_from(raw, start)
        if magic != self.magic:
            raise RowFormatError(key, ROW_FIELD, f"layout magic {magic!r}, expected {self.magic!r}")
        expected = header.size + sum(
            n * dtype.itemsize for n, (_, dtype) in zip(counts, self.dtypes, strict=True)
        )
        if expected != end - start:
            raise RowFormatError(key, ROW_FIELD, f"{end - start} bytes, its header describes {expected}")
        arrays: list[npt.NDArray[Any]] = []
        offset = start + header.size
        for count, (_, dtype) in zip(counts, self.dtypes, strict=True):
            arrays.append(np.frombuffer(raw, dtype=dtype, count=count, offset=offset))
            offset += count * dtype.itemsize
        return arrays


def _raw(part: npt.NDArray[Any] | bytes) -> bytes:
    return part if isinstance(part, bytes) else part.tobytes()


INT64 = np.dtype("<i8")
FLOAT32 = np.dtype("<f4")
BYTES = np.dtype("u1")

CALL_SECTIONS = Sections(
    b"TTC2",
    (
        ("counts", INT64),
        ("token_ids", INT64),
        ("token_mask", FLOAT32),
        ("logprobs", FLOAT32),
        ("meta", BYTES),
    ),
)
SAMPLE_SECTIONS = Sections(
    b"TTS2",
    (
        ("token_ids", INT64),
        ("weight_versions", INT64),
        ("token_mask", FLOAT32),
        ("logprobs", FLOAT32),
        ("meta", BYTES),
    ),
)
