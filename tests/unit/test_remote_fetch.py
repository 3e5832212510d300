"""The daemon's side of s3:// objects without a store: which URLs a daemon fetches (--allow-url,
daemon/access/urls.py), the acquire that names one (its ``pin``), a remote segment's metadata,
and where a dataset's rows lie in an object (hdf5/fetch.py), read from an in-memory HDF5 file.
Against a real S3 API server and a real daemon: tests/integration/test_remote_daemon.py."""

from __future__ import annotations

import io

import h5py
import msgpack
import numpy as np
import pytest

from h5serve import AccessDenied, ConfigError, ProtocolError, SegmentError
from h5serve.daemon.access.urls import UrlPolicy, check_url_shape, parse_allow_url
from h5serve.hdf5.fetch import RANGE_BYTES, remote_extents
from h5serve.hdf5.source import inspect_dataset
from h5serve.order.sharding import RowRange
from h5serve.segments import SegmentMeta
from h5serve.wire.protocol import Acquire, decode_request, encode_request


def test_a_shared_daemon_fetches_only_under_its_prefixes_by_whole_components() -> None:
    shared = UrlPolicy(("s3://b/data/",), shared=True)
    shared.check("s3://b/data/x.h5")
    shared.check("s3://b/data/deep/x.h5")
    for url in ("s3://b/database.h5", "s3://b/other/x.h5", "s3://c/data/x.h5"):
        with pytest.raises(AccessDenied, match="--allow-url"):
            shared.check(url)
    with pytest.raises(AccessDenied, match="--allow-url"):
        UrlPolicy((), shared=True).check("s3://b/data/x.h5")  # shared, no list: nothing
    UrlPolicy((), shared=False).check("s3://any/x.h5")  # a user's own daemon: whatever its credentials read
    with pytest.raises(AccessDenied):
        UrlPolicy(("s3://b/data/",), shared=False).check("s3://b/other/x.h5")  # a list given binds it too


@pytest.mark.parametrize("url", ["s3://b/data/../secret/x.h5", "s3://b/data/./x.h5", "s3://b/data//x.h5",
                                 "s3://b/data/x.h5?versionId=1", "s3://b/data/x.h5#f", "s3://u@b/data/x.h5",
                                 "s3://b", "https://h/data/x.h5", "s3://b/data/x\n.h5"])
def test_urls_that_could_leave_a_prefix_are_refused(url: str) -> None:
    with pytest.raises(AccessDenied):
        check_url_shape(url)
    with pytest.raises(AccessDenied):
        UrlPolicy(("s3://b/",), shared=True).check(url)


def test_allow_url_values() -> None:
    assert parse_allow_url("s3://b/data") == "s3://b/data/"
    assert parse_allow_url("s3://b/") == "s3://b/"
    for bad in ("/data", "https://h/x/", "s3://b/../x/", "s3://"):
        with pytest.raises(ConfigError, match="--allow-url"):
            parse_allow_url(bad)


def test_an_acquire_names_an_object_only_with_its_identity() -> None:
    req = Acquire("s3://b/k.h5", "x", 2, 1, "global", pin=(100, '"etag"', ""))
    _, back = decode_request(encode_request(7, req))
    assert back == req and isinstance(back, Acquire) and back.pin == (100, '"etag"', "")
    assert b"pin" not in encode_request(1, Acquire("/data/x.h5", "x", 1, 0))  # a local file: the message as before
    with pytest.raises(ProtocolError, match="absolute"):
        Acquire("s3://b/k.h5", "x", 1, 0)  # a URL without its identity
    with pytest.raises(ProtocolError, match="pin"):
        Acquire("/data/x.h5", "x", 1, 0, pin=(1, "", ""))
    for pin in ((-1, "", ""), (1, 2, ""), (1, ""), "x"):
        with pytest.raises(ProtocolError, match="pin"):
            Acquire("s3://b/k.h5", "x", 1, 0, pin=pin)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="files"):
        Acquire("s3://b/k.h5", "x", 1, 0, files=("s3://b/k.h5", "s3://b/l.h5"), pin=(1, "", ""))
    frame = msgpack.packb({"v": 1, "id": 3, "op": "acquire", "path": "s3://b/k.h5", "key": "x", "world_size": 1,
                           "rank": 0, "pin": [5, "e", "v"]})
    assert decode_request(frame)[1] == Acquire("s3://b/k.h5", "x", 1, 0, pin=(5, "e", "v"))


def test_an_acquire_names_many_objects_each_with_its_identity() -> None:
    files = ("s3://b/k.h5", "s3://b/l.h5")
    req = Acquire(files[0], "x", 2, 1, "global", files=files, pins=((100, '"e1"', ""), (200, '"e2"', "v")))
    _, back = decode_request(encode_request(7, req))
    assert back == req and isinstance(back, Acquire) and back.pins[1] == (200, '"e2"', "v")
    assert b"pins" not in encode_request(1, Acquire("/data/x.h5", "x", 1, 0))  # not many objects: as before
    with pytest.raises(ProtocolError, match="absolute"):
        Acquire(files[0], "x", 1, 0, files=files)  # URLs without their identities
    with pytest.raises(ProtocolError, match="pins"):
        Acquire(files[0], "x", 1, 0, files=files, pins=((1, "", ""),))  # one identity for two objects
    with pytest.raises(ProtocolError, match="pins"):
        Acquire("/d/a.h5", "x", 1, 0, files=("/d/a.h5", "/d/b.h5"), pins=((1, "", ""), (1, "", "")))
    with pytest.raises(ProtocolError, match="exclude"):
        Acquire(files[0], "x", 1, 0, files=files, pin=(1, "", ""), pins=((1, "", ""), (1, "", "")))
    with pytest.raises(ProtocolError, match="pin"):
        Acquire(files[0], "x", 1, 0, files=files, pins=((1, "", ""), (-1, "", "")))


def test_a_segment_of_many_objects_is_named_by_every_etag() -> None:
    files = (("s3://b/k.h5", 0, 0, 100, 0, 6), ("s3://b/l.h5", 0, 0, 100, 0, 4))
    meta = _meta(files=files, remote=('"e1"', "", '"e2"', ""))
    assert SegmentMeta.from_wire(msgpack.unpackb(msgpack.packb(meta.to_wire()))) == meta
    assert meta.identity() != _meta(files=files, remote=('"e1"', "", '"e3"', "")).identity()
    with pytest.raises(SegmentError, match="remote"):  # an ETag for each object, or none
        SegmentMeta.from_wire(msgpack.unpackb(msgpack.packb({**meta.to_wire(), "remote": ['"e1"', ""]})))


def _meta(**extra: object) -> SegmentMeta:
    return SegmentMeta(source_path="s3://b/k.h5", source_dev=0, source_ino=0, source_size=100, source_mtime_ns=0,
                       key="x", mode="global", world_size=1, rank=0, total_rows=10, rows=10, row_shape=(4,),
                       dtype="|u1", source_dtype="|u1", **extra)  # type: ignore[arg-type]


def test_a_remote_segment_is_named_by_its_etag() -> None:
    meta = _meta(remote=('"e1"', "v1"))
    assert SegmentMeta.from_wire(msgpack.unpackb(msgpack.packb(meta.to_wire()))) == meta
    assert meta.identity() != _meta(remote=('"e2"', "v1")).identity()
    assert "remote" not in _meta().to_wire()  # a local file's header: as before


def _in_memory(chunks: tuple[int, ...] | None, **options: object) -> tuple[h5py.File, io.BytesIO]:
    raw = io.BytesIO()
    with h5py.File(raw, "w") as f:
        f.create_dataset("x", data=np.arange(1000 * 64, dtype=np.uint8).reshape(1000, 64), chunks=chunks, **options)
    raw.seek(0)
    return h5py.File(raw, "r"), raw


def _bytes_at(raw: io.BytesIO, extents: list) -> bytes:
    data = raw.getvalue()
    out = bytearray()
    for e in extents:
        assert e.dest == len(out)
        out += data[e.start:e.start + e.size]
    return bytes(out)


@pytest.mark.parametrize("chunks", [(100, 64), (7, 64), None])
def test_the_ranges_of_consecutive_rows_hold_their_bytes(chunks: tuple[int, ...] | None) -> None:
    f, raw = _in_memory(chunks)
    with f:
        info = inspect_dataset(f, "x")
        for a, b in ((0, 1000), (13, 511), (999, 1000)):
            extents = remote_extents(f["x"], info, np.dtype(np.uint8), RowRange(a, b, 1))
            assert extents is not None and all(e.size <= max(RANGE_BYTES, 100 * 64) for e in extents)
            assert _bytes_at(raw, extents) == f["x"][a:b].tobytes()
        assert remote_extents(f["x"], info, np.dtype(np.uint8), RowRange(0, 1000, 3)) is None  # a stride: h5py
        assert remote_extents(f["x"], info, np.dtype(np.float32), RowRange(0, 10, 1)) is None  # a conversion


def test_filtered_or_partial_row_chunks_are_read_through_h5py() -> None:
    for chunks, options in (((100, 64), {"compression": "gzip"}), ((100, 32), {})):
        f, _ = _in_memory(chunks, **options)
        with f:
            assert remote_extents(f["x"], inspect_dataset(f, "x"), np.dtype(np.uint8), RowRange(0, 10, 1)) is None
