"""The log written by the schema-3 code (``tests/data``): three captured rollouts of
three calls, as the schema-3 worker, driver and ledger encoded them, and their rows.

It was produced by that code (``bench.rollouts.capture_rollouts`` and the ledger stage)
before schema 4 existed, so it is what a cluster mid-upgrade really holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import orjson

from topics.records import StagedCall

DATA = Path(__file__).parent / "data"


@dataclass(frozen=True, slots=True)
class LoggedV3:
    topic: str
    """``admission``, ``staged`` or ``committed`` (without the deployment's prefix)."""
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]


def schema3_log() -> list[LoggedV3]:
    lines = (DATA / "schema3_log.jsonl").read_bytes().splitlines()
    out = []
    for line in lines:
        item = orjson.loads(line)
        headers = [(name, value.encode()) for name, value in item["headers"].items()]
        out.append(LoggedV3(item["topic"], item["key"].encode(), item["value"].encode(), headers))
    return out


def schema3_rows() -> list[StagedCall]:
    lines = (DATA / "schema3_rows.jsonl").read_bytes().splitlines()
    return [StagedCall.model_validate(orjson.loads(line)) for line in lines]
