"""The durable store's indexed listing answers exactly what localbucket's full walk does,
and sees every write the server acknowledged; a stale conditional write is refused; what
retention has passed is deleted from the log's start; old batches are packed; and what
the store deletes leaves nothing behind in memory."""

from __future__ import annotations

import base64
import http.client
import json
import os
import threading
import time
import xml.etree.ElementTree as ET
from http.server import ThreadingHTTPServer
from pathlib import Path

import localbucket
import pytest
from batchkit import record_batch

from pipeline.kafka.embedded.expiry import Expired, expire
from pipeline.kafka.embedded.objectstore import FastS3Handler, FolderIndex
from pipeline.kafka.embedded.packing import Packed, pack

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
RECORDS = "clusters/c1/topics/t.a/partitions/0000000000/records/"


def token(marker: str) -> str:
    """A next-page token as localbucket hands them out."""
    return base64.urlsafe_b64encode(marker.encode()).decode()


UNREADABLE = token("nope")


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
    for _ in range(2):  # read from disk, then from the index
        assert handler()._list_entries(*arguments) == expected


def test_a_prefix_outside_the_bucket_lists_nothing(bucket: Path) -> None:
    (bucket.parent / "secret.txt").write_bytes(b"no")
    assert handler()._list_entries(bucket / "clusters", "../", "", "", False, 1000)[0] == []


def test_a_listing_sees_every_acknowledged_write(bucket: Path) -> None:
    FastS3Handler.data_root = bucket.parent
    server = ThreadingHTTPServer(("127.0.0.1", 0), FastS3Handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=5)
    folder = "clusters/c1/topics/t.a/partitions/0000000000/records/"

    def request(method: str, path: str, body: bytes | None = None) -> tuple[int, str]:
        connection.request(method, f"/{bucket.name}/{path}", body=body)
        reply = connection.getresponse()
        return reply.status, reply.read().decode()

    try:
        listings = []
        for offset in range(2, 6):
            listings.append(request("GET", f"?list-type=2&prefix={folder}"))
            assert request("PUT", f"{folder}{offset:020d}.batch", b"records")[0] == 200
        status, last = request("GET", f"?list-type=2&prefix={folder}")
        for body in (b"a", b"abcd"):  # an overwrite shows its new size
            assert request("PUT", f"{folder}{5:020d}.batch", body)[0] == 200
            overwritten = request("GET", f"?list-type=2&prefix={folder}")[1]
            assert f"<Size>{len(body)}</Size>" in overwritten
        assert request("DELETE", f"{folder}{2:020d}.batch")[0] == 204
        after_delete = request("GET", f"?list-type=2&prefix={folder}")[1]
    finally:
        connection.close()
        server.shutdown()
        server.server_close()
    assert status == 200 and all(code == 200 for code, _ in listings)
    assert [body.count("<Key>") for _, body in listings] == [2, 3, 4, 5]
    assert last.count("<Key>") == 6 and f"{5:020d}.batch" in last and "watermark" not in last
    assert after_delete.count("<Key>") == 5 and f"{2:020d}.batch" not in after_delete


@pytest.mark.parametrize(
    "query",
    [
        "list-type=2&prefix=clusters/c1/topics/t.a/partitions/0000000000/records/",
        "list-type=2&prefix=clusters/c1/topics/t.a/partitions/0000000000/records/&max-keys=1",
        "list-type=2&prefix=clusters/&start-after=clusters/c1/meta.json",
        "list-type=2&prefix=clusters/c1/topics/&delimiter=/",
        # the broker's next page of a partition of many batches, and a token that does not read
        f"list-type=2&prefix={RECORDS}&max-keys=1&continuation-token={token('K:' + RECORDS + '0' * 20 + '.batch')}",
        f"list-type=2&prefix=clusters/&max-keys=2&continuation-token={token('K:clusters/c1/meta.json')}",
        f"list-type=2&prefix={RECORDS}&continuation-token={UNREADABLE}",
    ],
)
def test_the_rendered_listing_is_localbucket_s(bucket: Path, query: str) -> None:
    answers = []
    for handler_class in (localbucket.S3Handler, FastS3Handler):
        handler_class.data_root = bucket.parent
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler_class)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        try:
            connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=5)
            connection.request("GET", f"/{bucket.name}?{query}")
            reply = connection.getresponse()
            answers.append((reply.status, reply.getheader("Content-Type"), canonical(reply.read())))
            connection.close()
        finally:
            server.shutdown()
            server.server_close()
    if UNREADABLE in query:
        assert answers[0][0] == 400
    else:
        assert answers[0][0] == 200 and ("<Contents>" in answers[0][2] or "<CommonPrefixes>" in answers[0][2])
    assert answers[1] == answers[0]


def test_a_listing_of_many_pages_is_localbucket_s(bucket: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Page by page through a partition of 2,500 batches, each page as localbucket
    answers it: the index serves the pages after the first as it serves the first
    (localbucket's own walk of the folder is not called)."""
    folder = bucket / RECORDS
    for offset in range(2, 2_500):
        (folder / f"{offset:020d}.batch").write_bytes(b"r")
    pages = []
    for handler_class in (localbucket.S3Handler, FastS3Handler):
        if handler_class is FastS3Handler:
            monkeypatch.setattr(localbucket.S3Handler, "_list_objects_v2", None)
        handler_class.data_root = bucket.parent
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler_class)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
        try:
            answers, query = [], f"list-type=2&prefix={RECORDS}"
            while True:
                connection.request("GET", f"/{bucket.name}?{query}")
                reply = connection.getresponse()
                body = reply.read()
                answers.append((reply.status, canonical(body)))
                following = ET.fromstring(body).findtext(
                    f"{{{localbucket.S3_NAMESPACE}}}NextContinuationToken"
                )
                if following is None:
                    break
                query = f"list-type=2&prefix={RECORDS}&continuation-token={following}"
        finally:
            connection.close()
            server.shutdown()
            server.server_close()
        pages.append(answers)
    assert len(pages[0]) == 3 and sum(body.count("<Key>") for _, body in pages[0]) == 2_500
    assert pages[1] == pages[0]


def canonical(xml: bytes) -> str:
    return ET.canonicalize(xml.decode(), strip_text=True)


def handler() -> FastS3Handler:
    """A handler outside any request: listings only need the index."""
    return FastS3Handler.__new__(FastS3Handler)


def test_a_write_naming_a_version_that_is_gone_is_refused(bucket: Path) -> None:
    """tansu updates a watermark naming the version it read (``If-Match``); a stale one is
    refused, so a log start the store raised meanwhile is read again, not written over."""
    FastS3Handler.data_root = bucket.parent
    server = ThreadingHTTPServer(("127.0.0.1", 0), FastS3Handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=5)
    key = "clusters/c1/topics/t.a/partitions/0000000000/watermark.json"

    def put(body: bytes, version: str) -> tuple[int, str | None]:
        connection.request("PUT", f"/{bucket.name}/{key}", body=body, headers={"If-Match": f'"{version}"'})
        reply = connection.getresponse()
        reply.read()
        return reply.status, reply.getheader("ETag")

    try:
        current = localbucket.object_etag(bucket / key)
        status, etag = put(b'{"low":null,"high":5}', current)
        assert status == 200 and etag is not None
        assert put(b'{"low":null,"high":6}', current)[0] == 412  # the version it named is gone
        assert (bucket / key).read_bytes() == b'{"low":null,"high":5}'
        assert put(b'{"low":null,"high":6}', etag.strip('"'))[0] == 200
        (bucket / key).unlink()
        assert put(b"{}", etag.strip('"'))[0] == 412  # nothing to replace
    finally:
        connection.close()
        server.shutdown()
        server.server_close()


PARTITION = "clusters/c1/topics/t.a/partitions/0000000000"


def kept_for(bucket: Path, retention: dict[str, str]) -> None:
    """Topic ``t.a``'s configs in tansu's ``meta.json``."""
    configs = [{"name": name, "value": value} for name, value in retention.items()]
    meta = {"topics": {"t.a": {"topic": {"name": "t.a", "configs": configs}}}}
    (bucket / "clusters/c1/meta.json").write_text(json.dumps(meta))


def aged(bucket: Path, ages_s: list[float], now: float) -> list[Path]:
    """Batches at offsets 0, 1, ... appended ``ages_s`` before ``now``; the watermark past them."""
    records = bucket / PARTITION / "records"
    for path in records.glob("*.batch"):
        path.unlink()
    paths = []
    for offset, age in enumerate(ages_s):
        path = records / f"{offset:020d}.batch"
        path.write_bytes(b"batch")
        os.utime(path, (now - age, now - age))
        paths.append(path)
    (bucket / PARTITION / "watermark.json").write_text(json.dumps({"low": None, "high": len(ages_s)}))
    return paths


def held(bucket: Path, index: FolderIndex) -> list[str]:
    return [entry.path.name for entry in index.entries(bucket, f"{PARTITION}/records")]


def test_expiry_deletes_the_oldest_batches_past_retention_and_moves_the_log_start(bucket: Path) -> None:
    now, index = time.time(), FolderIndex()
    kept_for(bucket, {"retention.ms": "10000", "cleanup.policy": "delete"})
    aged(bucket, [60, 50, 40, 5, 30, 1], now)  # the 5 s one stops it: only the log's start goes
    assert len(held(bucket, index)) == 6  # cached before: the deletion updates the index
    assert expire(bucket, index, threading.Lock(), now) == [Expired("t.a", 0, log_start=3, batches=3)]
    assert held(bucket, index) == [f"{offset:020d}.batch" for offset in (3, 4, 5)]
    assert sorted(path.name for path in (bucket / PARTITION / "records").glob("*.batch")) == held(
        bucket, index
    )
    assert json.loads((bucket / PARTITION / "watermark.json").read_text()) == {"low": 3, "high": 6}
    assert expire(bucket, index, threading.Lock(), now) == []


def test_expiry_keeps_the_newest_batch_and_never_lowers_the_log_start(bucket: Path) -> None:
    now, index = time.time(), FolderIndex()
    kept_for(bucket, {"retention.ms": "1000"})
    aged(bucket, [60, 50, 40], now)
    assert expire(bucket, index, threading.Lock(), now) == [Expired("t.a", 0, log_start=2, batches=2)]
    assert held(bucket, index) == [f"{2:020d}.batch"]
    (bucket / PARTITION / "watermark.json").write_text(json.dumps({"low": 9, "high": 10}))
    (bucket / PARTITION / "records" / f"{9:020d}.batch").write_bytes(b"batch")
    index = FolderIndex()
    assert expire(bucket, index, threading.Lock(), now) == [Expired("t.a", 0, log_start=9, batches=1)]
    assert json.loads((bucket / PARTITION / "watermark.json").read_text())["low"] == 9


@pytest.mark.parametrize(
    "retention", [{"retention.ms": "-1"}, {"retention.ms": "1000", "cleanup.policy": "compact"}, {}]
)
def test_expiry_spares_what_its_topic_keeps(bucket: Path, retention: dict[str, str]) -> None:
    """Kept forever, compacted (not deleted), or kept Kafka's default of 7 days."""
    now = time.time()
    kept_for(bucket, retention)
    aged(bucket, [3600, 3600, 1], now)
    assert expire(bucket, FolderIndex(), threading.Lock(), now) == []
    assert len(list((bucket / PARTITION / "records").glob("*.batch"))) == 3


def test_a_retention_that_does_not_read_is_refused_naming_the_topic(bucket: Path) -> None:
    kept_for(bucket, {"retention.ms": "soon"})
    with pytest.raises(ValueError, match=r"topic t\.a: retention\.ms 'soon' is not an integer"):
        expire(bucket, FolderIndex(), threading.Lock())


def test_packing_rewrites_old_batches_as_one_and_forgets_the_rest(bucket: Path) -> None:
    """The index shows the pack in place of its batches, and localbucket's ETag memory
    holds no entry for a deleted batch."""
    now, index = time.time(), FolderIndex()
    paths = aged(bucket, [60, 50, 40, 1], now)
    for path in paths:
        path.write_bytes(record_batch(int(path.stem), 1))
        os.utime(path, (now - 60, now - 60))
    os.utime(paths[-1], (now, now))
    etags = [localbucket.object_etag(path) for path in paths]  # as a listing leaves them cached
    assert len(held(bucket, index)) == 4
    assert pack(bucket, index, after_s=10, now=now) == [Packed("t.a", 0, batches=3, packs=1)]
    assert held(bucket, index) == [f"{offset:020d}.batch" for offset in (0, 3)]
    assert sorted(path.name for path in (bucket / PARTITION / "records").glob("*.batch")) == held(
        bucket, index
    )
    assert all(str(path) not in localbucket._etag_cache for path in paths[1:3])
    assert localbucket.object_etag(paths[0]) != etags[0]  # the pack is a new object
    assert pack(bucket, index, after_s=10, now=now) == []  # one pack and the newest: nothing to do


def test_expiry_forgets_the_etags_of_what_it_deleted(bucket: Path) -> None:
    now, index = time.time(), FolderIndex()
    kept_for(bucket, {"retention.ms": "1000"})
    paths = aged(bucket, [60, 50, 1], now)
    for path in paths:
        localbucket.object_etag(path)
    expire(bucket, index, threading.Lock(), now)
    assert [str(path) in localbucket._etag_cache for path in paths] == [False, False, True]


BAD_KEYS = [
    f"{RECORDS}..",
    f"{RECORDS}.",
    f"{RECORDS}../../escape",
    f"{RECORDS}",
    "clusters/c1/./meta.json",
]


def test_keys_in_a_known_folder_are_answered_as_localbucket_s(bucket: Path) -> None:
    """Once a folder's path is known the store stops resolving it: a bad key in it, or a
    bucket gone, is still refused as localbucket refuses it, and a good one lands where
    localbucket puts it (the same request, twice, after the folder became known)."""
    requests = [
        ("PUT", f"{RECORDS}00000000000000000009.batch", b"nine"),
        ("GET", f"{RECORDS}00000000000000000009.batch", b""),
        *[(method, key, b"x") for key in BAD_KEYS for method in ("PUT", "GET")],
        ("GET", f"{RECORDS}00000000000000000001.batch", b""),
    ]
    answers = []
    for handler_class in (localbucket.S3Handler, FastS3Handler, FastS3Handler):
        handler_class.data_root = bucket.parent
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler_class)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=5)
        replies = []
        try:
            for method, key, body in requests:
                connection.request(method, f"/{bucket.name}/{key}", body=body or None)
                reply = connection.getresponse()
                replies.append((method, key, reply.status, reply.read() if reply.status == 200 else b""))
            connection.request("GET", f"/gone/{RECORDS}00000000000000000001.batch")
            reply = connection.getresponse()
            reply.read()
            replies.append(("GET", "gone bucket", reply.status, b""))
        finally:
            connection.close()
            server.shutdown()
            server.server_close()
        answers.append(replies)
        (bucket / f"{RECORDS}00000000000000000009.batch").unlink()
    assert [status for _, _, status, _ in answers[0]].count(200) == 3  # the two good reads and the write
    assert answers[1] == answers[0] and answers[2] == answers[0]
    assert not (bucket.parent / "escape").exists()
