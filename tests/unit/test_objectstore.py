"""The durable store's scoped listing answers exactly what localbucket's full walk does."""

from __future__ import annotations

import http.client
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import localbucket
import pytest

from pipeline.objectstore import FastS3Handler, scoped_keys

KEYS = [
    "clusters/c1/meta.json",
    "clusters/c1/topics/t.a/partitions/0000000000/records/00000000000000000000.batch",
    "clusters/c1/topics/t.a/partitions/0000000000/records/00000000000000000001.batch",
    "clusters/c1/topics/t.a/partitions/0000000000/watermark.json",
    "clusters/c1/topics/t.a/partitions/0000000001/records/00000000000000000000.batch",
    "clusters/c1/topics/t.b/partitions/0000000000/records/00000000000000000007.batch",
    "clusters/c1/groups/consumers/g.json",
    "top.json",
]


@pytest.fixture
def bucket(tmp_path: Path) -> Path:
    """A bucket named ``tansu`` in a store root, holding ``KEYS`` and a file being written."""
    bucket = tmp_path / "root" / "tansu"
    for key in KEYS:
        path = bucket / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(key.encode())
    (bucket / "clusters/c1/topics/t.a/partitions/0000000000/records/.localbucket-tmp").write_bytes(b"x")
    return bucket


@pytest.mark.parametrize(
    ("prefix", "delimiter", "marker", "max_keys"),
    [
        ("", "", "", 1000),
        ("clusters/", "", "", 1000),
        ("clusters/c1/topics/t.a/partitions/0000000000/records/", "", "", 1000),
        ("clusters/c1/topics/t.a/partitions/0000000000/records/", "", "", 1),
        (
            "clusters/c1/topics/t.a/partitions/0000000000/records/",
            "",
            "clusters/c1/topics/t.a/partitions/0000000000/records/00000000000000000000.batch",
            1000,
        ),
        ("clusters/c1/topics/t.", "", "", 1000),
        ("clusters/c1/topics/", "/", "", 1000),
        ("clusters/c1/topics/", "/", "clusters/c1/topics/t.a/", 1000),
        ("clusters/c1/nothing/", "", "", 1000),
        ("clusters/c1/topics/t.a/partitions/0000000000/watermark.json", "", "", 1000),
    ],
)
def test_listing_matches_the_full_walk(
    bucket: Path, prefix: str, delimiter: str, marker: str, max_keys: int
) -> None:
    marker_is_prefix = bool(delimiter) and marker.endswith(delimiter)
    arguments = (bucket, prefix, delimiter, marker, marker_is_prefix, max_keys)
    expected = localbucket.S3Handler._list_entries(None, *arguments)
    assert FastS3Handler._list_entries(None, *arguments) == expected


def test_a_prefix_outside_the_bucket_lists_nothing(bucket: Path) -> None:
    (bucket.parent / "secret.txt").write_bytes(b"no")
    assert scoped_keys(bucket / "clusters", "../") == []


def test_the_server_answers_a_prefixed_listing(bucket: Path) -> None:
    root = bucket.parent
    FastS3Handler.data_root = root
    server = ThreadingHTTPServer(("127.0.0.1", 0), FastS3Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=5)
        prefix = "clusters/c1/topics/t.a/partitions/0000000000/records/"
        connection.request("GET", f"/{bucket.name}?list-type=2&prefix={prefix}")
        reply = connection.getresponse()
        body = reply.read().decode()
        connection.close()
    finally:
        server.shutdown()
        server.server_close()
    assert reply.status == 200
    assert body.count("<Key>") == 2 and "00000000000000000001.batch" in body and "watermark" not in body
