"""The S3-compatible server behind the durable embedded broker: localbucket, made fast.

tansu's durable engine keeps every record batch, watermark and committed offset as an
object, so a broker's speed is its store's. localbucket (buckets as plain folders) is
the store; its handler gets two changes here, both measured (bench/RESULTS.md):

* replies go out without Nagle's delay: headers and body are two writes, and the second
  waited for the client's delayed acknowledgement, about 40 ms per request, which
  capped a consumer reading single-record batches at ~30 a second;
* a listing walks only the folder its prefix names, not the whole bucket: the broker
  lists one partition's records on every fetch, and a walk of every object of every
  topic made each fetch slower as the log grew.

Run as ``python -m pipeline.objectstore ROOT --host HOST --port PORT``; the module
imports nothing of the runtime, so the store starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from http.server import ThreadingHTTPServer
from pathlib import Path

import localbucket


class FastS3Handler(localbucket.S3Handler):  # type: ignore[misc]  # the library ships no types
    """localbucket's handler with prompt replies and listings scoped to their prefix."""

    disable_nagle_algorithm = True

    def _list_entries(
        self,
        bucket_dir: Path,
        prefix: str,
        delimiter: str,
        marker: str,
        marker_is_prefix: bool,
        max_keys: int,
    ) -> tuple[list[tuple[str, Path]], list[str], bool, str]:
        """One page of keys and common prefixes after ``marker``, read from the prefix's folder."""
        contents: list[tuple[str, Path]] = []
        common_prefixes: list[str] = []
        last_entry = ""
        for key, path in scoped_keys(bucket_dir, prefix):
            if marker and (key.encode() <= marker.encode() or (marker_is_prefix and key.startswith(marker))):
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
                contents.append((key, path))
                last_entry = "K:" + key
        return contents, common_prefixes, False, last_entry


def scoped_keys(bucket_dir: Path, prefix: str) -> list[tuple[str, Path]]:
    """Every object key starting with ``prefix``, in S3's byte order, with its file.

    A key under ``a/b/c`` lies in folder ``a/b/``, so only that folder is walked.
    Files being written (localbucket's temporary names) are not objects yet, and a
    prefix climbing out of the bucket names nothing.
    """
    folder = prefix.rpartition("/")[0]
    if ".." in folder.split("/"):
        return []
    scope = bucket_dir / folder
    keys: list[tuple[str, Path]] = []
    for directory, _, files in os.walk(scope):
        for name in files:
            if name.startswith(localbucket.TEMP_PREFIX):
                continue
            path = Path(directory, name)
            key = path.relative_to(bucket_dir).as_posix()
            if key.startswith(prefix):
                keys.append((key, path))
    keys.sort(key=lambda item: item[0].encode())
    return keys


def serve(root: Path, host: str, port: int) -> None:
    """Serve ``root``'s folders as buckets until interrupted; only warnings are logged."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s [%(levelname)s]: %(message)s")
    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    FastS3Handler.data_root = root
    server = ThreadingHTTPServer((host, port), FastS3Handler)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipeline.objectstore", description=__doc__)
    parser.add_argument("root", type=Path, help="folder holding the buckets")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, required=True, help="port to listen on")
    args = parser.parse_args(argv)
    serve(args.root, args.host, args.port)


if __name__ == "__main__":
    main()
