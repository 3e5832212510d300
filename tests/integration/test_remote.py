"""Remote files (issue 34, groundwork): ``SharedH5Dataset("s3://bucket/key.h5")`` against a real
S3 API server on loopback (moto's server mode, in this process's threads), read lazily through
fsspec/s3fs: the same rows in the same order as the same file on disk in every mode the lazy
path has; 404 and 403 as h5serve's errors naming the URL and never the secret key; an object
rewritten mid-job is SourceChanged, in the process reading it and in one opening it afresh
(a spawned worker); patterns of s3:// keys; a running daemon is never sent a URL.

Skipped, with the reason, where moto[server] or s3fs is not installed (``pip install -e '.[test]'``
installs both)."""

from __future__ import annotations

import logging
import pickle
import traceback
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from h5serve import ConfigError, ObjectAccessDenied, ObjectNotFound, SourceChanged
from h5serve.client import SharedH5Dataset, collate, make_loader

from ..helpers import Daemon, make_h5

pytestmark = pytest.mark.timeout(120)

moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed: pip install -e '.[test]'")
pytest.importorskip("s3fs", reason="s3fs is not installed: pip install -e '.[s3]'")

SECRET = "h5serve-test-secret-Zq81Kx"  # must appear in no message
BUCKET = "h5serve-test"
ROWS, SHAPE = 3001, (4, 4)  # 64-row chunks: 47 of them, 48 KiB of x


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 (a free port), stopped on the way out."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_daemon_env: Path) -> Any:
    """An s3fs filesystem on the server, with a fresh bucket, and the environment every h5serve
    open sees: dummy credentials, the endpoint, no ~/.aws."""
    import s3fs

    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": SECRET,
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3_endpoint,
                        "AWS_CONFIG_FILE": str(tmp_path / "none"),
                        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True)
    if not fs.exists(BUCKET):
        fs.mkdir(BUCKET)
    return fs


@pytest.fixture
def local(tmp_path: Path) -> Path:
    return make_h5(tmp_path / "train.h5", rows=ROWS, row_shape=SHAPE)


def upload(fs: Any, path: Path, key: str) -> str:
    fs.put_file(str(path), f"{BUCKET}/{key}")
    return f"s3://{BUCKET}/{key}"


def opened(path: str | Path | list[str], **kwargs: Any) -> SharedH5Dataset:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no daemon / remote files: read here, as expected
        return SharedH5Dataset(path, "x", "y", **kwargs)


def rows_at(ds: SharedH5Dataset, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x, y = collate(ds.__getitems__(positions))
    return np.asarray(x), np.asarray(y)


def every_row(ds: SharedH5Dataset) -> tuple[np.ndarray, np.ndarray]:
    return rows_at(ds, np.arange(len(ds)))


@pytest.mark.parametrize("mode,rank,world", [("contiguous", 1, 3), ("interleave", 2, 3), ("global", 0, 2)])
def test_same_rows_and_order_as_the_local_file(s3: Any, local: Path, mode: str, rank: int, world: int) -> None:
    url = upload(s3, local, f"{mode}/train.h5")
    for cache_bytes in (None, 0):  # the chunk cache, and h5py reads per batch
        remote = opened(url, mode=mode, rank=rank, world_size=world, cache_bytes=cache_bytes)
        here = opened(local, mode=mode, rank=rank, world_size=world, cache_bytes=cache_bytes)
        assert remote.backend == "lazy" and remote.files == (url,)
        np.testing.assert_array_equal(remote.indices, here.indices)
        for a, b in zip(every_row(remote), every_row(here)):
            np.testing.assert_array_equal(a, b)
        shuffled = np.random.default_rng(5).permutation(len(here))[:100]
        for a, b in zip(rows_at(remote, shuffled), rows_at(here, shuffled)):
            np.testing.assert_array_equal(a, b)
        remote.close()
        here.close()


def test_stream_mode_reads_the_same_batches_in_the_same_order(s3: Any, local: Path) -> None:
    url = upload(s3, local, "stream/train.h5")
    runs = []
    for path in (url, local):
        ds = opened(path, mode="stream", rank=0, world_size=1, window="16KiB", block_rows=128)
        assert ds.backend == "lazy"
        runs.append([tuple(np.asarray(t).copy() for t in b) for b in make_loader(ds, 100, seed=3)])
        ds.close()
    assert len(runs[0]) == len(runs[1]) == -(-ROWS // 100)
    for (xa, ya), (xb, yb) in zip(*runs):
        np.testing.assert_array_equal(ya, yb)
        np.testing.assert_array_equal(xa, xb)
    assert sorted(np.concatenate([y for _x, y in runs[0]]).tolist()) == list(range(ROWS))


def test_a_pattern_of_keys_is_the_files_in_sorted_order(s3: Any, tmp_path: Path) -> None:
    files = [make_h5(tmp_path / f"run_{i}.h5", rows=200 + 50 * i, row_shape=SHAPE) for i in range(3)]
    urls = [upload(s3, f, f"runs/{f.name}") for f in reversed(files)]
    ds = opened(f"s3://{BUCKET}/runs/run_*.h5", mode="global")
    assert ds.files == tuple(sorted(urls))
    listed = opened(sorted(urls), mode="interleave", rank=1, world_size=2)
    here = opened([str(f) for f in files], mode="interleave", rank=1, world_size=2)
    for a, b in zip(every_row(listed), every_row(here)):
        np.testing.assert_array_equal(a, b)
    assert len(ds) == sum(200 + 50 * i for i in range(3))


def test_a_missing_object_or_bucket_is_object_not_found_naming_the_url(s3: Any) -> None:
    for url in (f"s3://{BUCKET}/nothing/here.h5", "s3://no-such-bucket-h5serve/train.h5"):
        with pytest.raises(ObjectNotFound) as info:
            opened(url)
        assert url in str(info.value) and info.value.url == url and info.value.status == 404
        assert isinstance(info.value, FileNotFoundError)  # also a SourceNotFound, as for a local file
    with pytest.raises(ObjectNotFound, match="matches no object"):
        opened(f"s3://{BUCKET}/nothing/run_*.h5")


def _set_auth(endpoint: str, requests_without_auth: str) -> None:
    """moto's switch for checking credentials ("0": from now on; "inf": never)."""
    request = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=requests_without_auth.encode(),
                                     method="POST", headers={"Content-Type": "text/plain"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.status == 200


def test_refused_credentials_are_access_denied_naming_the_url_never_the_secret(s3: Any, s3_endpoint: str,
                                                                               local: Path) -> None:
    url = upload(s3, local, "denied/train.h5")
    _set_auth(s3_endpoint, "0")  # the dummy key is in no account moto knows: 403 from here on
    try:
        with pytest.raises(ObjectAccessDenied) as info:
            opened(url)
    finally:
        _set_auth(s3_endpoint, "inf")
    exc = info.value
    assert url in str(exc) and exc.status == 403 and "403" in str(exc)
    assert isinstance(exc, PermissionError)
    shown = "".join(traceback.format_exception(exc))  # the message, and every error it was raised from
    assert SECRET not in shown and SECRET not in repr(exc)


def test_an_object_rewritten_mid_job_is_source_changed(s3: Any, local: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import h5serve.hdf5.remote as remote

    monkeypatch.setattr(remote, "BLOCK_BYTES", 8 << 10)  # small blocks, few kept: later rows need new requests
    monkeypatch.setattr(remote, "CACHE_BLOCKS", 2)
    url = upload(s3, local, "rewritten/train.h5")
    ds = opened(url, mode="global", cache_bytes=0)
    np.testing.assert_array_equal(rows_at(ds, np.arange(10))[1], np.arange(10))
    worker = pickle.dumps(ds)  # what a spawned DataLoader worker is sent, before the object changes
    upload(s3, make_h5(tmp_path / "other.h5", rows=ROWS, row_shape=SHAPE, dtype="int16"), "rewritten/train.h5")
    with pytest.raises(SourceChanged) as info:
        rows_at(ds, np.arange(ROWS - 10, ROWS))
    assert url in str(info.value)
    fresh = pickle.loads(worker)  # opens the object afresh: checked against the identity described
    with pytest.raises(SourceChanged, match="changed since this job described it") as info:
        rows_at(fresh, np.arange(10))
    assert url in str(info.value)


def test_a_running_daemon_is_never_sent_a_url(s3: Any, local: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from h5serve.client.dataset import REMOTE_WARNING

    url = upload(s3, local, "daemon/train.h5")
    d = Daemon()
    try:
        d.start()
        monkeypatch.setenv("H5SERVE_RUNTIME_DIR", str(d.runtime_dir))
        with pytest.warns(RuntimeWarning) as caught:
            ds = SharedH5Dataset(url, "x", "y", mode="global", wait_ready=True)
        assert [str(w.message) for w in caught] == [REMOTE_WARNING]
        assert ds.backend == "lazy" and len(ds) == ROWS
        with pytest.raises(ConfigError, match="does not fetch remote files"):
            SharedH5Dataset(url, "x", "y", mode="global", fallback="error")
        assert d.status()["segments"] == []  # nothing was asked of it
    finally:
        d.stop()
