"""A copy of a durable store that may be live: what a reader of a running data directory
opens instead of the store itself, which its own broker holds.

The store's upkeep deletes and rewrites batch objects as it runs (``expiry``, ``packing``),
so a partition copied while one of its runs was packed can hold a pack and some of the
batches it replaced (offsets twice) or an old first batch without the rest (a gap). A
partition's batches are whole when each ends where the next begins; one that is not is
copied again until it is.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from pipeline.kafka.embedded.unwritten import BATCH_SUFFIX, batch_end

COPY_ATTEMPTS = 5
"""Copies of one partition before giving up: packing touches a partition every few seconds
for milliseconds, so a second copy is whole."""


class TornCopy(OSError):
    """A partition's batches did not copy whole in ``COPY_ATTEMPTS`` tries."""


def copy_store(store: Path, copy: Path) -> None:
    """Copy ``store`` to ``copy`` (which must not exist), each partition's batches whole."""
    shutil.copytree(store, copy, copy_function=_copy_if_there)
    for records in sorted(copy.glob("*/clusters/*/topics/*/partitions/*/records")):
        source = store / records.relative_to(copy)
        for _ in range(COPY_ATTEMPTS):
            if whole(records):
                break
            shutil.rmtree(records)
            shutil.copytree(source, records, copy_function=_copy_if_there)
        else:
            raise TornCopy(f"{source}: its batches changed under every copy of {COPY_ATTEMPTS}")


def whole(records: Path) -> bool:
    """Whether the batch objects in ``records`` follow one another, each ending where the
    next begins (a batch is named by its first offset; its header gives its last)."""
    names = sorted(name for name in os.listdir(records) if name.endswith(BATCH_SUFFIX))
    end: int | None = None
    for name in names:
        base = int(name.removesuffix(BATCH_SUFFIX))
        if end is not None and base != end:
            return False
        try:
            end = batch_end(records / name, base)
        except ValueError:  # shorter than a header: torn
            return False
    return True


def _copy_if_there(source: str, destination: str) -> None:
    """Copy one object; one deleted since it was listed is gone from the copy too."""
    with contextlib.suppress(FileNotFoundError):
        shutil.copy2(source, destination)
