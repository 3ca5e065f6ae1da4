"""In-memory ports for unit tests and single-stage benchmarks.

They sit beside the real Kafka and TransferQueue implementations (every behaviour is
also tested against those); they exist so that logic can be tested in milliseconds
and so that a benchmark can isolate one stage from the broker and the data plane.
"""

from __future__ import annotations

from collections.abc import Sequence

from stages.ports import SAMPLES_PARTITION, STAGING_PARTITION, DataPlaneError, MissingRows
from topics.events import Envelope, envelope
from topics.records import Record, StagedCall, TrainingSample
from topics.staging import CallRow, as_record


class MemoryDataPlane:
    """A dict per partition; ``broken`` makes every call fail like a dead data plane."""

    def __init__(self) -> None:
        self.calls: dict[str, StagedCall] = {}
        self.samples: dict[str, TrainingSample] = {}
        self.broken = False

    def _check(self) -> None:
        if self.broken:
            raise DataPlaneError("data plane is down")

    async def put_calls(self, rows: Sequence[CallRow]) -> None:
        self._check()
        self.calls.update((row.staging_key, as_record(row)) for row in rows)

    async def get_calls(self, keys: Sequence[str]) -> dict[str, StagedCall]:
        self._check()
        missing = [key for key in keys if key not in self.calls]
        if missing:
            raise MissingRows(STAGING_PARTITION, missing)
        return {key: self.calls[key] for key in keys}

    async def delete_calls(self, keys: Sequence[str]) -> None:
        self._check()
        for key in keys:
            self.calls.pop(key, None)

    async def put_samples(self, samples: Sequence[TrainingSample]) -> None:
        self._check()
        self.samples.update((sample.key, sample) for sample in samples)

    async def get_samples(self, keys: Sequence[str]) -> dict[str, TrainingSample]:
        self._check()
        missing = [key for key in keys if key not in self.samples]
        if missing:
            raise MissingRows(SAMPLES_PARTITION, missing)
        return {key: self.samples[key] for key in keys}

    async def delete_samples(self, keys: Sequence[str]) -> None:
        self._check()
        for key in keys:
            self.samples.pop(key, None)

    async def list_keys(self, partition: str) -> list[str]:
        self._check()
        store = self.calls if partition == STAGING_PARTITION else self.samples
        return sorted(store)


class RecordingSink:
    """Keeps every published event in order; ``broken`` makes publishing fail."""

    def __init__(self) -> None:
        self.events: list[Envelope[Record]] = []
        self.broken = False

    async def publish(self, records: Sequence[Record]) -> None:
        if self.broken:
            raise ConnectionError("broker is down")
        self.events.extend(envelope(record) for record in records)

    def payloads(self, kind: type[Record]) -> list[Record]:
        return [event.payload for event in self.events if isinstance(event.payload, kind)]
