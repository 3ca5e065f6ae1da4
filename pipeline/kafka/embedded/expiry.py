"""Retention that deletes, in the durable store: what a topic's ``retention.ms`` has
passed goes, and the partition's log start moves past it.

tansu records a topic's retention and deletes nothing, so a data directory's log only
grew. Its durable engine keeps each record batch as an object named by its first offset,
which the store serves, so the store deletes them instead, as Kafka deletes a segment:
whole batches, from the log start on, each once it has been in the log longer than its
topic keeps records (by the time it was appended: the pipeline's topics ask for log
append time, which tansu does not stamp, so a batch's object time stands for it);
regardless of consumer groups, whose loss ``tokentrail lag`` and the consumer loop name
(DESIGN §7.6). A partition's newest batch stays, as Kafka keeps its active segment: the
first batch left is always where its log starts.

The log start tansu reports (the fetch's log start, ``watermark.json``'s ``low``) is
raised before the batches go. tansu writes that object back from its own copy on every
produce, naming the version it read (``If-Match``); the store refuses a stale one, so the
raised start is read again, never undone (``pipeline.kafka.embedded.objectstore``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeline.kafka.embedded.listing import Listing
from pipeline.kafka.embedded.unwritten import WATERMARK, read_watermark, stored_batches, write_watermark

RETENTION_CHECK_S = 60.0
"""How often the store deletes what retention has passed (Kafka checks every 5 minutes)."""
KAFKA_DEFAULT_RETENTION_MS = 7 * 86_400_000
"""A topic created without ``retention.ms`` keeps records as long as Kafka's default."""
META = "meta.json"

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Expired:
    """One partition whose oldest batches were deleted."""

    topic: str
    partition: int
    log_start: int
    """The offset its log starts at now: the first batch left."""
    batches: int
    """How many batches went."""


def positive_seconds(text: str) -> float:
    """``--retention-check-s``: a number of seconds above 0."""
    value = float(text)
    if not value > 0:
        raise ValueError(f"retention check interval: {text} is not a number of seconds above 0")
    return value


def expire(bucket_dir: Path, index: Listing, lock: threading.Lock, now: float | None = None) -> list[Expired]:
    """Delete every batch under ``bucket_dir`` (one bucket of tansu's clusters) that its
    topic's retention has passed at ``now`` (the clock: seconds since the epoch)."""
    now = time.time() if now is None else now
    expired: list[Expired] = []
    for cluster_dir in sorted((bucket_dir / "clusters").glob("*")):
        retention = topic_retention_ms(cluster_dir / META)
        for topic, partition_dir in _partitions(cluster_dir):
            retention_ms = retention.get(topic, KAFKA_DEFAULT_RETENTION_MS)
            if retention_ms is None:
                continue
            gone = _expire_partition(bucket_dir, partition_dir, retention_ms, now, index, lock)
            if gone is not None:
                expired.append(Expired(topic, int(partition_dir.name), *gone))
    return expired


def topic_retention_ms(meta_path: Path) -> dict[str, int | None]:
    """``retention.ms`` per topic as tansu stores it (``None``: never deleted by time:
    -1, or a cleanup policy without ``delete``); a topic without one is not listed."""
    try:
        meta = json.loads(meta_path.read_bytes())
    except FileNotFoundError:
        return {}
    retention: dict[str, int | None] = {}
    for name, topic in (meta.get("topics") or {}).items():
        configs = {
            entry["name"]: entry.get("value") for entry in (topic.get("topic") or {}).get("configs") or []
        }
        if "delete" not in (configs.get("cleanup.policy") or "delete").split(","):
            retention[name] = None
        elif configs.get("retention.ms") is not None:
            try:
                value = int(configs["retention.ms"])
            except ValueError:
                raise ValueError(
                    f"{meta_path}: topic {name}: retention.ms {configs['retention.ms']!r} is not an integer"
                ) from None
            retention[name] = None if value < 0 else value
    return retention


def _partitions(cluster_dir: Path) -> Iterator[tuple[str, Path]]:
    for topic_dir in sorted((cluster_dir / "topics").glob("*")):
        for partition_dir in sorted((topic_dir / "partitions").glob("*")):
            if partition_dir.name.isdigit():
                yield topic_dir.name, partition_dir


def _expire_partition(
    bucket_dir: Path, partition_dir: Path, retention_ms: int, now: float, index: Listing, lock: threading.Lock
) -> tuple[int, int] | None:
    """Delete the partition's oldest batches past ``retention_ms``, never its newest;
    returns its new log start and how many went, or None when none did."""
    batches = stored_batches(partition_dir / "records")
    doomed: list[Path] = []
    for batch in batches[:-1]:
        if (now - batch.written_at) * 1000 <= retention_ms:
            break
        doomed.append(batch.path)
    if not doomed:
        return None
    log_start = batches[len(doomed)].base
    _raise_log_start(bucket_dir, partition_dir / WATERMARK, log_start, index, lock)

    def remove() -> None:
        for path in doomed:
            path.unlink(missing_ok=True)

    index.removed(bucket_dir, doomed, remove)
    return log_start, len(doomed)


def _raise_log_start(
    bucket_dir: Path, path: Path, log_start: int, index: Listing, lock: threading.Lock
) -> None:
    """The watermark's ``low`` raised to ``log_start`` (never lowered), under the store's
    lock for conditional writes, so a produce that read it before is refused and reads again."""
    with lock, index.writing(path, forget=False):
        watermark = read_watermark(path)
        low = watermark.get("low")
        if isinstance(low, int) and low >= log_start:
            return
        write_watermark(path, {**watermark, "low": log_start})
        index.written(bucket_dir, path)
