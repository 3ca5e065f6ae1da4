"""The finalizer's sample copies on disk (``SampleSpool``, DESIGN §7.4): a file a batch.

Each batch of samples the finalizer wrote becomes one file of JSON lines, written under a
temporary name and renamed, so a file is whole or absent; a file goes once none of its
samples is needed. Surviving the process is the point (a ``kill -9``, a crash while the
data plane's owner is being replaced), not surviving the machine: nothing is fsynced, the
page cache outlives the process. Several finalizers may share a directory: each loads
every file at start, and removing a file another already removed is harmless.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from topics.records import TrainingSample

log = logging.getLogger(__name__)

SUFFIX = ".jsonl"
PARTIAL = ".partial"
UNREADABLE = ".unreadable"


class DirectorySpool:
    """``SampleSpool`` in a directory of its own (created 0700: samples are training data)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._serial = itertools.count()

    def write(self, samples: Sequence[TrainingSample]) -> str:
        name = f"{time.time_ns():020d}-{os.getpid()}-{next(self._serial)}{SUFFIX}"
        partial = self.directory / (name + PARTIAL)
        partial.write_bytes(b"".join(sample.model_dump_json().encode() + b"\n" for sample in samples))
        partial.rename(self.directory / name)
        return name

    def remove(self, spool_id: str) -> None:
        (self.directory / spool_id).unlink(missing_ok=True)

    def load(self) -> list[tuple[str, list[TrainingSample]]]:
        """Every whole file, oldest first; leftovers of an interrupted write are deleted, and
        a file that does not parse is set aside (renamed ``.unreadable``) and logged."""
        for partial in self.directory.glob(f"*{PARTIAL}"):
            partial.unlink(missing_ok=True)
        batches: list[tuple[str, list[TrainingSample]]] = []
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            try:
                lines = path.read_bytes().splitlines()
                batches.append((path.name, [TrainingSample.model_validate_json(line) for line in lines]))
            except FileNotFoundError:
                continue  # another finalizer sharing the directory let it go meanwhile
            except (ValidationError, ValueError) as exc:
                log.error("sample spool file %s is unreadable, set aside: %s", path, exc)
                path.rename(path.with_name(path.name + UNREADABLE))
        return batches
