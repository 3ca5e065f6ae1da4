"""Kafka record batches as tansu's durable store keeps them: one object per produced batch."""

from __future__ import annotations

import struct

from aiokafka.record.default_records import DefaultRecordBatchBuilder

TIMESTAMP_MS = 1_700_000_000_000


def record_batch(base: int, count: int) -> bytes:
    """``count`` records as a producer sends them (offsets from 0), stored at ``base``;
    record at offset ``o`` has key ``k{o}``, value ``v{o}``, header ``n=o`` and time
    ``TIMESTAMP_MS + o``."""
    builder = DefaultRecordBatchBuilder(2, 0, 0, -1, -1, -1, 1 << 20)
    for delta in range(count):
        offset = base + delta
        builder.append(
            delta,
            TIMESTAMP_MS + offset,
            f"k{offset}".encode(),
            f"v{offset}".encode(),
            [("n", str(offset).encode())],
        )
    built = builder.build()
    built[:8] = struct.pack(">q", base)
    return bytes(built)
