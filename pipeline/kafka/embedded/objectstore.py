"""The S3-compatible server behind the durable embedded broker: localbucket, made fast.

tansu's durable engine keeps every record batch, watermark and committed offset as an
object, so a broker's speed is its store's. localbucket (buckets as plain folders) is
the store; its handler gets four changes here, the first three measured (bench/RESULTS.md):

* replies go out at once and whole: without Nagle's delay (headers and body were two
  writes, and the second waited for the client's delayed acknowledgement, about 40 ms
  per request, which capped a consumer reading single-record batches at ~30 a second),
  and buffered until the request is done, so a short reply is one write;
* a key's folder is resolved (for links) once, not on every request;
* a listing reads only the folder its prefix names, not the whole bucket, and from an
  index the server keeps (``FolderIndex``): the broker lists one partition's records on
  every fetch, and a walk, a stat and an XML element of every object made each fetch
  slower as the log grew; entries are now rendered once, when written, a page starts
  where its marker falls (a bisection), and the pages after the first (a partition of
  over 1,000 batches) come from the index too;
* a write that names the version it replaces (``If-Match``, how tansu updates a watermark)
  is refused when the object has changed since (localbucket ignores the header), so a
  watermark the store moves itself (``pipeline.kafka.embedded.expiry``) is read again,
  never written back over.

It also deletes what the topics' retention says (``pipeline.kafka.embedded.expiry``,
every ``--retention-check-s``) and packs old batches into few (``pipeline.kafka.embedded.packing``,
every ``--pack-every-s``), through the same index.

``EmbeddedBroker`` runs it as ``python -m pipeline.kafka.embedded.objectstore ROOT --host HOST
--port PORT``. The handler overrides localbucket's own methods, so the project pins its
version (pyproject.toml); ``tests/unit/test_objectstore.py`` compares every answer with
localbucket's.
"""

from __future__ import annotations

import argparse
import base64
import bisect
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from http import HTTPStatus
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import IO, NamedTuple
from urllib.parse import unquote, urlsplit
from xml.sax.saxutils import escape

import localbucket

from pipeline.kafka.embedded.expiry import RETENTION_CHECK_S, expire, positive_seconds
from pipeline.kafka.embedded.packing import PACK_AFTER_S, PACK_EVERY_S, drop_replaced, pack

log = logging.getLogger(__name__)


class Entry(NamedTuple):
    """One object as a listing shows it, its ``<Contents>`` element rendered once."""

    key: str
    path: Path
    xml: str


class FolderIndex:
    """The objects under each listed folder, kept exact by the server's own writes.

    The broker lists a partition's records on every fetch; reading the folder and
    statting each file every time made each fetch cost as much as the log was long.
    An object written is put into every cached folder above it before the write is
    acknowledged; a deletion forgets those folders; a listing read from disk while a
    write was under way is answered but not kept. So a kept folder never misses an
    acknowledged write. The store is locked to one server (``EmbeddedBroker``), so no
    write bypasses the index.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[Path, list[Entry]] = {}
        self._generation: Counter[Path] = Counter()
        self._writing: Counter[Path] = Counter()

    def entries(self, bucket_dir: Path, folder: str) -> list[Entry]:
        """Every object under ``bucket_dir/folder``, in S3's byte order of keys."""
        scope = bucket_dir / folder
        with self._lock:
            cached = self._entries.get(scope)
            generation = self._generation[scope]
        if cached is not None:
            return cached
        fresh = read_entries(bucket_dir, scope)
        with self._lock:
            if self._generation[scope] == generation and not self._writing[scope]:
                self._entries[scope] = fresh
        return fresh

    @contextmanager
    def writing(self, path: Path, *, forget: bool) -> Iterator[None]:
        """Around a request that changes ``path``; ``forget`` drops the folders above it."""
        folders = list(path.parents)
        self._mark(folders, 1, forget)
        try:
            yield
        finally:
            self._mark(folders, -1, False)

    def written(self, bucket_dir: Path, path: Path) -> None:
        """``path`` was just written: every cached folder above it shows it as it is now."""
        key = path.relative_to(bucket_dir).as_posix()
        with self._lock:  # read under the lock, so the last update applied is the newest
            entry = read_entry(bucket_dir, path)
            for folder in path.parents:
                cached = self._entries.get(folder)
                if cached is not None:
                    self._entries[folder] = replaced(cached, key, entry)

    def removed(self, bucket_dir: Path, paths: Collection[Path], remove: Callable[[], None]) -> None:
        """Call ``remove`` (which deletes ``paths`` from disk); every cached folder above
        them stops showing them, in one copy per folder, so a listing being answered
        never sees entries move."""
        gone = {path.relative_to(bucket_dir).as_posix() for path in paths}
        folders = sorted({folder for path in paths for folder in path.parents})
        self._mark(folders, 1, False)
        try:
            remove()
            forget_etags(paths)
            with self._lock:
                for folder in folders:
                    cached = self._entries.get(folder)
                    if cached is not None:
                        self._entries[folder] = [entry for entry in cached if entry.key not in gone]
        finally:
            self._mark(folders, -1, False)

    def rewritten(
        self, bucket_dir: Path, kept: Path, gone: Collection[Path], rewrite: Callable[[], None]
    ) -> None:
        """Call ``rewrite`` (which deletes ``gone`` and rewrites ``kept`` on disk); every
        cached folder above them then changes in one step, so a listing answered meanwhile
        shows the objects as they were, one answered after as they are."""
        keys_gone = {path.relative_to(bucket_dir).as_posix() for path in gone}
        key_kept = kept.relative_to(bucket_dir).as_posix()
        folders = sorted({folder for path in (kept, *gone) for folder in path.parents})
        self._mark(folders, 1, False)
        try:
            rewrite()
            forget_etags(gone)
            with self._lock:
                entry = read_entry(bucket_dir, kept)
                for folder in folders:
                    cached = self._entries.get(folder)
                    if cached is not None:
                        left = [cached_entry for cached_entry in cached if cached_entry.key not in keys_gone]
                        self._entries[folder] = replaced(left, key_kept, entry)
        finally:
            self._mark(folders, -1, False)

    def _mark(self, folders: list[Path], step: int, forget: bool) -> None:
        with self._lock:
            for folder in folders:
                self._generation[folder] += 1
                self._writing[folder] += step
                if forget:
                    self._entries.pop(folder, None)


def forget_etags(paths: Collection[Path]) -> None:
    """localbucket remembers every object's ETag by path and forgets none (it deletes
    nothing on its own): the objects this store deletes are forgotten with them, or its
    memory grows by an entry for every batch ever produced."""
    with localbucket._etag_lock:
        for path in paths:
            localbucket._etag_cache.pop(str(path), None)


INDEX = FolderIndex()
WRITING_METHODS = frozenset({"PUT", "POST", "DELETE"})
RESOLVED_FOLDERS: dict[tuple[Path, str], Path] = {}
"""A folder of a bucket (``a/b`` of key ``a/b/c``) as its real path; about one per
partition of the broker's."""
CONDITIONAL_WRITES = threading.Lock()
"""Held from reading an object's version to replacing it: by a write with ``If-Match``
and by the store's own read-modify-writes, so neither passes the other."""


class FastS3Handler(localbucket.S3Handler):  # type: ignore[misc]  # the library ships no types
    """localbucket's handler with prompt replies and indexed, pre-rendered listings."""

    disable_nagle_algorithm = True
    wbufsize = -1
    """A reply is buffered and sent when its request is done (``http.server`` flushes
    then), so its headers and a short body leave in one write, not two."""
    _listed: dict[str, Entry]

    def handle_expect_100(self) -> bool:
        """A client waiting for ``100 Continue`` before its body must get it now, not
        with the buffered reply."""
        proceed: bool = super().handle_expect_100()
        self.wfile.flush()
        return proceed

    def _object_path(self, bucket: str, key: str) -> Path:
        """localbucket's path of a key, its folder resolved once: resolving (for links a
        store of plain folders never holds) on every request was a tenth of the store's
        CPU. A key is checked in full the first time its folder is seen."""
        folder, _, name = key.rpartition("/")
        seen = (self.data_root / bucket, folder)
        resolved = RESOLVED_FOLDERS.get(seen)
        if resolved is None or name in ("", ".", ".."):
            path: Path = super()._object_path(bucket, key)
            if path.name == name:
                RESOLVED_FOLDERS[seen] = path.parent
            return path
        self._bucket_dir(bucket)  # a bucket deleted since: NoSuchBucket, as localbucket says
        return resolved / name

    def _dispatch(self, action: Callable[[str, str], None]) -> None:
        if self.command not in WRITING_METHODS:
            super()._dispatch(action)
            return
        bucket, _, key = unquote(urlsplit(self.path).path).lstrip("/").partition("/")
        with INDEX.writing(self.data_root / bucket / key, forget=self.command == "DELETE"):
            super()._dispatch(action)

    def _write_object(self, bucket: str, key: str, write: Callable[[IO[bytes]], str]) -> str:
        """Every write of an object; the index shows it before the write is acknowledged.
        One naming the version it replaces (``If-Match``) is refused when that is not
        the object's version now, or there is no object: the writer reads it again."""
        expected = self.headers.get("If-Match")
        if expected is None:
            return self._write_indexed(bucket, key, write)
        with CONDITIONAL_WRITES:
            target = self._object_path(bucket, key)
            if not target.is_file() or not localbucket.etag_matches(
                expected, localbucket.object_etag(target)
            ):
                raise self._precondition_failed_error()
            return self._write_indexed(bucket, key, write)

    def _write_indexed(self, bucket: str, key: str, write: Callable[[IO[bytes]], str]) -> str:
        etag: str = super()._write_object(bucket, key, write)
        INDEX.written(self.data_root / bucket, self._object_path(bucket, key))
        return etag

    def _list_entries(
        self,
        bucket_dir: Path,
        prefix: str,
        delimiter: str,
        marker: str,
        marker_is_prefix: bool,
        max_keys: int,
    ) -> tuple[list[tuple[str, Path]], list[str], bool, str]:
        """One page of keys and common prefixes after ``marker``, from the prefix's folder."""
        contents: list[tuple[str, Path]] = []
        common_prefixes: list[str] = []
        last_entry = ""
        self._listed = {}
        folder = prefix.rpartition("/")[0]  # a key under a/b/c lies in folder a/b/
        if ".." in folder.split("/"):
            return contents, common_prefixes, False, last_entry
        entries = INDEX.entries(bucket_dir, folder)
        # Keys sharing a prefix are contiguous in byte order: start at the prefix, or past
        # the marker, and stop at the first key beyond the prefix.
        start = bisect.bisect_left(entries, prefix.encode(), key=_byte_order)
        if marker:
            start = max(start, bisect.bisect_right(entries, marker.encode(), key=_byte_order))
        for at in range(start, len(entries)):
            entry = entries[at]
            key = entry.key
            if not key.startswith(prefix):
                break
            if marker_is_prefix and key.startswith(marker):
                continue
            cut = key.find(delimiter, len(prefix)) if delimiter else -1
            common = key[: cut + len(delimiter)] if cut >= 0 else ""
            if common and common_prefixes and common_prefixes[-1] == common:
                continue
            if len(contents) + len(common_prefixes) >= max_keys:
                return contents, common_prefixes, max_keys > 0, last_entry
            if common:
                common_prefixes.append(common)
                last_entry = "P:" + common
            else:
                contents.append((key, entry.path))
                self._listed[key] = entry
                last_entry = "K:" + key
        return contents, common_prefixes, False, last_entry

    def _list_objects_v2(self, bucket: str) -> None:
        """The broker's own listing (a prefix, perhaps a start or a next page) from
        pre-rendered entries; any other listing, or a token that does not read, as
        localbucket answers it."""
        token = self.query.get("continuation-token")
        marker = _token_marker(token) if token is not None else self.query.get("start-after", "")
        if set(self.query) - FAST_LISTING or marker is None:
            super()._list_objects_v2(bucket)
            return
        prefix, start_after = self.query.get("prefix", ""), self.query.get("start-after", "")
        max_keys = self._max_keys()
        contents, _, truncated, last_entry = self._list_entries(
            self._bucket_dir(bucket), prefix, "", marker, False, max_keys
        )
        parts = [
            f'<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult xmlns="{localbucket.S3_NAMESPACE}">',
            _element("Name", bucket),
            _element("Prefix", prefix),
            _element("MaxKeys", str(max_keys)),
            _element("KeyCount", str(len(contents))),
            _element("IsTruncated", "true" if truncated else "false"),
        ]
        if token is not None:
            parts.append(_element("ContinuationToken", token))
        if truncated:  # the token localbucket reads back on the next page
            parts.append(
                _element("NextContinuationToken", base64.urlsafe_b64encode(last_entry.encode()).decode())
            )
        if start_after:
            parts.append(_element("StartAfter", start_after))
        parts += [self._listed[key].xml for key, _ in contents]
        parts.append("</ListBucketResult>")
        self._send(HTTPStatus.OK, "".join(parts).encode(), {"Content-Type": "application/xml"})


FAST_LISTING = frozenset({"list-type", "prefix", "start-after", "max-keys", "continuation-token"})


def _token_marker(token: str) -> str | None:
    """The key a next-page token continues after (localbucket's ``K:key`` tokens, the only
    ones a listing without a delimiter hands out); None for any other token."""
    try:
        decoded = base64.urlsafe_b64decode(token.encode()).decode()
    except ValueError:
        return None
    return decoded[2:] if decoded.startswith("K:") else None


def read_entries(bucket_dir: Path, scope: Path) -> list[Entry]:
    """Every object under ``scope``, read from disk; files being written are not objects yet."""
    entries: list[Entry] = []
    for directory, _, files in os.walk(scope):
        for name in files:
            if not name.startswith(localbucket.TEMP_PREFIX):
                entry = read_entry(bucket_dir, Path(directory, name))
                if entry is not None:
                    entries.append(entry)
    entries.sort(key=_byte_order)
    return entries


def read_entry(bucket_dir: Path, path: Path) -> Entry | None:
    """The object at ``path`` as a listing shows it; None if there is none."""
    try:
        stat = path.stat()
        etag: str = localbucket.object_etag(path)
    except FileNotFoundError:
        return None
    key = path.relative_to(bucket_dir).as_posix()
    xml = (
        f"<Contents>{_element('Key', key)}"
        f"{_element('LastModified', localbucket.iso_timestamp(stat.st_mtime))}"
        f'<ETag>"{etag}"</ETag>{_element("Size", str(stat.st_size))}'
        "<StorageClass>STANDARD</StorageClass></Contents>"
    )
    return Entry(key, path, xml)


def replaced(entries: list[Entry], key: str, entry: Entry | None) -> list[Entry]:
    """``entries`` with ``key``'s entry put in place, or removed when None. A new last
    entry (the next batch of a partition, the common case) is appended to the list
    itself, which a listing being answered reads no further than its length when it
    began; anything else changes a copy, so such a listing never sees entries move."""
    if entry is not None and (not entries or _byte_order(entries[-1]) < key.encode()):
        entries.append(entry)
        return entries
    updated = list(entries)
    at = bisect.bisect_left(updated, key.encode(), key=_byte_order)
    if at < len(updated) and updated[at].key == key:
        del updated[at]
    if entry is not None:
        updated.insert(at, entry)
    return updated


def _byte_order(entry: Entry) -> bytes:
    return entry.key.encode()


def _element(tag: str, text: str) -> str:
    return f"<{tag}>{escape(text)}</{tag}>"


@dataclass(frozen=True, slots=True)
class Upkeep:
    """The store's own work on its objects: retention (``expiry``) and packing."""

    retention_check_s: float = RETENTION_CHECK_S
    pack_every_s: float = PACK_EVERY_S
    pack_after_s: float = PACK_AFTER_S


def keep_up(root: Path, upkeep: Upkeep, stopped: threading.Event) -> None:
    """Delete what retention has passed and pack what has become packable, each at its own
    interval, one at a time (both rewrite a partition's oldest batches), until ``stopped``;
    a pass that fails is logged and the next one tried."""
    due = {"retention": time.monotonic() + upkeep.retention_check_s, "packing": time.monotonic()}
    every = {"retention": upkeep.retention_check_s, "packing": upkeep.pack_every_s}
    while not stopped.wait(max(0.0, min(due.values()) - time.monotonic())):
        for work, at in due.items():
            if at > time.monotonic():
                continue
            due[work] = time.monotonic() + every[work]
            for bucket_dir in sorted(path for path in root.iterdir() if path.is_dir()):
                try:
                    if work == "retention":
                        expire(bucket_dir, INDEX, CONDITIONAL_WRITES)
                    else:
                        pack(bucket_dir, INDEX, upkeep.pack_after_s)
                except (OSError, ValueError):
                    log.exception("%s in %s failed", work, bucket_dir)


def serve(root: Path, host: str, port: int, upkeep: Upkeep | None = None) -> None:
    """Serve ``root``'s folders as buckets until interrupted, keeping them up (``keep_up``);
    only warnings are logged."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s [%(levelname)s]: %(message)s")
    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    if dropped := drop_replaced(root):
        log.warning("deleted %d batch(es) a pack already held (a store killed while packing)", dropped)
    FastS3Handler.data_root = root
    server = ThreadingHTTPServer((host, port), FastS3Handler)
    stopped = threading.Event()
    keeping = threading.Thread(
        target=keep_up, args=(root, upkeep or Upkeep(), stopped), name="upkeep", daemon=True
    )
    keeping.start()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        stopped.set()
        server.server_close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.kafka.embedded.objectstore", description=__doc__
    )
    parser.add_argument("root", type=Path, help="folder holding the buckets")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, required=True, help="port to listen on")
    parser.add_argument(
        "--retention-check-s",
        type=positive_seconds,
        default=RETENTION_CHECK_S,
        help="how often records past their topic's retention are deleted (default: %(default)s)",
    )
    parser.add_argument(
        "--pack-every-s",
        type=positive_seconds,
        default=PACK_EVERY_S,
        help="how often old batches are packed (default: %(default)s)",
    )
    parser.add_argument(
        "--pack-after-s",
        type=float,
        default=PACK_AFTER_S,
        help="how old a batch is before it is packed (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    serve(
        args.root, args.host, args.port, Upkeep(args.retention_check_s, args.pack_every_s, args.pack_after_s)
    )


if __name__ == "__main__":
    main()
