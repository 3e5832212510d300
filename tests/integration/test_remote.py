"""Remote files (issue 34, groundwork): ``SharedH5Dataset("s3://bucket/key.h5")`` against a real
S3 API server on loopback (moto's server mode in a process of its own: bench/s3server.py), read lazily through
fsspec/s3fs: the same rows in the same order as the same file on disk in every mode the lazy
path has; 404 and 403 as h5serve's errors naming the URL and never the secret key; an object
rewritten mid-job is SourceChanged, in the process reading it and in one opening it afresh
(a spawned worker); patterns of s3:// keys; a running daemon is never sent what it does not fetch
(variable-length rows).

Skipped, with the reason, where moto[server] or s3fs is not installed (``pip install -e '.[test]'``
installs both)."""

from __future__ import annotations

import gc
import http.client
import http.server
import os
import pickle
import re
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from h5serve import ConfigError, ObjectAccessDenied, ObjectNotFound, ObjectStoreError, SourceChanged
from h5serve.client import SharedH5Dataset, collate, make_loader

from ..helpers import Daemon, make_h5, output_or_kill, vlen_file

pytestmark = pytest.mark.timeout(120)

moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed: pip install -e '.[test]'")
pytest.importorskip("s3fs", reason="s3fs is not installed: pip install -e '.[s3]'")

SECRET = "h5serve-test-secret-Zq81Kx"  # must appear in no message
BUCKET = "h5serve-test"
ROWS, SHAPE = 3001, (4, 4)  # 64-row chunks: 47 of them, 48 KiB of x


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 (a free port) in a process of its own, killed on the way out.
    Not in this process's threads: a read here holds h5py's lock while it waits for the server,
    whose garbage collection could need that lock (threadloop.py)."""
    from bench.s3server import S3Server
    with S3Server(as_is=True) as server:
        yield server.endpoint


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


def messages(exc: BaseException) -> str:
    """Every message a traceback of ``exc`` prints: its own and those of the errors it was raised from."""
    out: list[str] = []
    at: BaseException | None = exc
    while at is not None and len(out) < 20:
        out.append(f"{type(at).__name__}: {at} {at.args!r}")
        at = at.__cause__ or (None if at.__suppress_context__ else at.__context__)
    return "\n".join(out)


def rows_at(ds: SharedH5Dataset, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x, y = collate(ds.__getitems__(positions))
    return np.asarray(x), np.asarray(y)


def every_row(ds: SharedH5Dataset) -> tuple[np.ndarray, np.ndarray]:
    return rows_at(ds, np.arange(len(ds)))


MODES = {"contiguous": {"rank": 1, "world_size": 3}, "interleave": {"rank": 2, "world_size": 3},
         "global": {"rank": 0, "world_size": 2},
         "node": {"local_rank": 1, "local_world_size": 2, "node_rank": 1, "num_nodes": 2}}


@pytest.mark.parametrize("mode", MODES)
def test_same_rows_and_order_as_the_local_file(s3: Any, local: Path, mode: str) -> None:
    url = upload(s3, local, f"{mode}/train.h5")
    for cache_bytes in (None, 0):  # the chunk cache, and h5py reads per batch
        remote = opened(url, mode=mode, cache_bytes=cache_bytes, **MODES[mode])
        here = opened(local, mode=mode, cache_bytes=cache_bytes, **MODES[mode])
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


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_read_the_same_batches(s3: Any, local: Path, context: str) -> None:
    url = upload(s3, local, f"workers-{context}/train.h5")
    runs = []
    for path in (url, local):
        ds = opened(path, mode="interleave", rank=0, world_size=2)
        loader = make_loader(ds, 64, seed=7, num_workers=2, multiprocessing_context=context, timeout=60)
        runs.append([tuple(np.asarray(t).copy() for t in batch) for batch in loader])
        ds.close()
    assert len(runs[0]) == len(runs[1]) > 1
    for (xa, ya), (xb, yb) in zip(*runs):
        np.testing.assert_array_equal(ya, yb)
        np.testing.assert_array_equal(xa, xb)


def test_an_https_url_reads_the_same_rows(s3: Any, s3_endpoint: str, local: Path, tmp_path: Path) -> None:
    """fsspec's http filesystem (aiohttp) on the same server: an object GET by path, unsigned
    (moto checks no credentials here), ranged as any https server's; rewritten mid-job (same
    size), SourceChanged at the next request."""
    s3.chmod(upload(s3, local, "http/train.h5"), "public-read")
    url = f"{s3_endpoint}/{BUCKET}/http/train.h5"
    over_http = opened(url, mode="contiguous", rank=0, world_size=2)
    here = opened(local, mode="contiguous", rank=0, world_size=2)
    for a, b in zip(every_row(over_http), every_row(here)):
        np.testing.assert_array_equal(a, b)
    # rewritten with the same size mid-job: its next request carries the ETag opened (If-Match), so
    # the server refuses it (412) rather than answering bytes of the new version
    import h5serve.hdf5.remote as remote

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(remote, "BLOCK_BYTES", 8 << 10)
        patch.setattr(remote, "CACHE_BLOCKS", 2)
        reading = opened(url, mode="global", cache_bytes=0)
        np.testing.assert_array_equal(rows_at(reading, np.arange(10))[1], np.arange(10))
        changed = tmp_path / "changed.h5"
        data = bytearray(local.read_bytes())
        data[-4096:] = bytes(255 - b for b in data[-4096:])  # the same size, other bytes (the last rows' x)
        changed.write_bytes(bytes(data))
        s3.chmod(upload(s3, changed, "http/train.h5"), "public-read")
        with pytest.raises(SourceChanged) as changed_info:
            rows_at(reading, np.arange(ROWS - 10, ROWS))
        assert url in str(changed_info.value)
    with pytest.raises(ObjectNotFound) as info:
        opened(f"{s3_endpoint}/{BUCKET}/http/none.h5?X-Amz-Signature=abc")
    assert f"{s3_endpoint}/{BUCKET}/http/none.h5" in str(info.value)
    assert "Signature" not in messages(info.value)  # a presigned URL's credential


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
    assert SECRET not in messages(exc) and SECRET not in "".join(traceback.format_exception(exc))


def test_an_object_rewritten_mid_job_is_source_changed(s3: Any, local: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import h5serve.hdf5.remote as remote

    monkeypatch.setattr(remote, "BLOCK_BYTES", 8 << 10)  # small blocks, few kept: later rows need new requests
    monkeypatch.setattr(remote, "CACHE_BLOCKS", 2)
    url = upload(s3, local, "rewritten/train.h5")
    before = remote.remote_identity(url)
    ds = opened(url, mode="global", cache_bytes=0)
    np.testing.assert_array_equal(rows_at(ds, np.arange(10))[1], np.arange(10))
    worker = pickle.dumps(ds)  # what a spawned DataLoader worker is sent, before the object changes
    upload(s3, make_h5(tmp_path / "other.h5", rows=ROWS, row_shape=SHAPE, dtype="int16"), "rewritten/train.h5")
    after = remote.remote_identity(url)
    assert before.size == local.stat().st_size and before.etag and after.etag != before.etag
    with pytest.raises(SourceChanged) as info:
        rows_at(ds, np.arange(ROWS - 10, ROWS))
    assert url in str(info.value)
    fresh = pickle.loads(worker)  # opens the object afresh: checked against the identity described
    with pytest.raises(SourceChanged, match="changed since this job described it") as info:
        rows_at(fresh, np.arange(10))
    assert url in str(info.value)


def test_what_the_daemon_does_not_fetch_is_read_here(s3: Any, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Variable-length rows of an object are read by each process, said once, never sent to the
    daemon (tests/integration/test_remote_daemon.py, test_remote_stream.py, test_remote_files.py:
    what it fetches)."""
    from h5serve.client.remote import REMOTE_WARNING

    url = upload(s3, vlen_file(tmp_path / "vlen.h5", {"v": 0.05}, first_rows=64, rows=200, first_length=3),
                 "daemon/vlen.h5")
    d = Daemon("--allow-url", f"s3://{BUCKET}/")
    try:
        d.start()
        monkeypatch.setenv("H5SERVE_RUNTIME_DIR", str(d.runtime_dir))
        with pytest.warns(RuntimeWarning) as caught:
            ds = SharedH5Dataset(url, "v", mode="global", wait_ready=True)
        assert [str(w.message) for w in caught] == [REMOTE_WARNING]
        assert ds.backend == "lazy" and len(ds) == 200
        with pytest.raises(ConfigError, match="fetches s3:// objects of fixed-size rows"):
            SharedH5Dataset(url, "v", mode="stream", window="1MiB", block_rows=16, fallback="error")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            streamed = SharedH5Dataset(url, "v", mode="stream", window="1MiB", block_rows=16)
        assert streamed.backend == "lazy" and streamed.stream is not None
        assert sum(len(b) for b in make_loader(streamed, 10, seed=1)) == 200
        assert d.status()["segments"] == []  # nothing was asked of it
    finally:
        d.stop()


def test_inspect_reports_an_object_as_it_reports_its_local_copy_plus_its_size(s3: Any, local: Path) -> None:
    import json
    import subprocess
    import sys

    url = upload(s3, local, "inspect/train.h5")
    identity = s3.info(url)
    runs = {}
    for name, path in (("remote", url), ("local", str(local))):
        out = subprocess.run([sys.executable, "-m", "h5serve", "inspect", path, "--json"], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        runs[name] = json.loads(out.stdout)
    remote, here = runs["remote"], runs["local"]
    assert remote["file"] == url and remote["file_bytes"] == identity["size"] == local.stat().st_size
    assert identity["ETag"] in remote["remote"] and here["remote"] == ""
    for field in ("datasets", "needs", "recommended_mode"):
        assert remote[field] == here[field]
    text = subprocess.run([sys.executable, "-m", "h5serve", "inspect", url], capture_output=True, text=True,
                          timeout=60)
    assert text.returncode == 0 and text.stdout.startswith(f"{url} (") and "remote object:" in text.stdout
    missing = subprocess.run([sys.executable, "-m", "h5serve", "inspect", f"s3://{BUCKET}/inspect/none.h5"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and f"s3://{BUCKET}/inspect/none.h5" in missing.stderr
    assert "Traceback" not in missing.stderr and SECRET not in missing.stderr


class FaultyProxy(http.server.ThreadingHTTPServer):
    """A loopback HTTP proxy in front of the S3 server that spoils the next ``faults`` ranged
    GETs (the reads of file data) as ``kind`` says: ``"503"`` answers S3's SlowDown, ``"reset"``
    sends the headers and half the body, then closes the connection."""

    daemon_threads = True

    def __init__(self, upstream: str) -> None:
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.upstream = upstream.removeprefix("http://")
        self.kind, self.faults, self.spoiled = "", 0, 0
        self.lock = threading.Lock()
        self.get_bytes = 0  # body bytes of every successful GET passed on (what the store sent)
        self.headers_seen: list[str] = []  # every request's headers, as sent to the store
        self.methods: dict[str, int] = {}  # requests passed on, by method
        # called with each ranged GET's Range header before it is passed on, until it returns True once
        self.before_range: Callable[[str], bool] | None = None
        self.slow: list[str] = []  # requests that took the proxy more than 2 s, with their times

    def count(self, command: str, status: int, size: int, headers: str) -> None:
        with self.lock:
            self.headers_seen.append(headers)
            self.methods[command] = self.methods.get(command, 0) + 1
            if command == "GET" and 200 <= status < 300:
                self.get_bytes += size

    def run_hook(self, range_header: str) -> None:
        with self.lock:
            if self.before_range is not None and self.before_range(range_header):
                self.before_range = None

    def take_fault(self) -> str:
        with self.lock:
            if self.faults <= 0:
                return ""
            self.faults -= 1
            self.spoiled += 1
            return self.kind


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    server: FaultyProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _forward(self) -> None:
        began = time.monotonic()
        try:
            self._pass_on()
        finally:
            took = time.monotonic() - began
            if took > 2:  # what a failure report needs: which requests the proxy was slow to answer
                self.server.slow.append(f"{self.command} {self.headers.get('Range')}: {took:.1f}s")

    def _pass_on(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        fault = self.server.take_fault() if self.command == "GET" and "Range" in self.headers else ""
        if fault == "503":
            text = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)
            return
        if self.command == "GET" and "Range" in self.headers:
            self.server.run_hook(self.headers["Range"])
        upstream = http.client.HTTPConnection(self.server.upstream, timeout=30)
        try:
            upstream.request(self.command, self.path, body=body or None, headers=dict(self.headers))
            reply = upstream.getresponse()
            data = reply.read()
        finally:
            upstream.close()
        self.server.count(self.command, reply.status, len(data), str(self.headers))
        self.send_response(reply.status)
        for name, value in reply.getheaders():
            if name.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                self.send_header(name, value)
        # a HEAD's Content-Length is the object's size, not the (empty) body's
        self.send_header("Content-Length", reply.getheader("Content-Length", "0") if self.command == "HEAD"
                         else str(len(data)))
        self.end_headers()
        if fault == "reset":  # a connection reset mid-range: half the promised bytes, then gone
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self.wfile.write(data)

    do_GET = do_HEAD = do_PUT = _forward


@contextmanager
def serving(proxy: FaultyProxy) -> Iterator[FaultyProxy]:
    """``proxy`` serving from a thread of this process until the block ends. Meanwhile this
    process collects no cyclic garbage on its own: a proxy thread collecting an h5py object
    would wait for h5py's lock, held by a read here that waits for that thread's answer
    (threadloop.py); a store is never in the reading process, so only this test setup needs it."""
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield proxy
    finally:
        if collecting:
            gc.enable()
        proxy.shutdown()
        proxy.server_close()
        thread.join(timeout=10)


@pytest.fixture
def faulty(s3: Any, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultyProxy]:
    """h5serve's requests through a FaultyProxy (its endpoint in AWS_ENDPOINT_URL), with small
    blocks so that reads keep reaching the store, and short waits between tries."""
    import h5serve.hdf5.remote as remote

    with serving(FaultyProxy(s3_endpoint)) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.server_address[1]}")
        monkeypatch.setattr(remote, "BLOCK_BYTES", 8 << 10)
        monkeypatch.setattr(remote, "CACHE_BLOCKS", 2)
        monkeypatch.setattr(remote, "RETRY", remote.RetryPolicy(attempts=4, first_s=0.01, cap_s=0.05, deadline_s=20))
        # a request the loaded proxy is slow to answer is tried again after 10 s, not failed after 60
        monkeypatch.setattr(remote, "READ_TIMEOUT_S", 10.0)
        yield proxy


_GC_LITTER = """
import gc, sys, h5py, numpy as np, warnings
import h5serve.hdf5.remote as remote
from h5serve.client import SharedH5Dataset, collate
warnings.simplefilter("ignore", RuntimeWarning)
remote.BLOCK_BYTES, remote.CACHE_BLOCKS = 4096, 2  # every read a request or more


class Holder:
    pass


def litter():  # h5py objects only the cyclic collector frees, in whichever thread it runs
    for _ in range(20):
        h = Holder()
        h.me, h.plist = h, h5py.h5p.create(h5py.h5p.FILE_ACCESS)


gc.set_threshold(30, 1, 1)  # a collection every few allocations, in any thread
ds = SharedH5Dataset(sys.argv[1], "x", "y", mode="global", cache_bytes=0, fallback="lazy")
rng = np.random.default_rng(0)
for _ in range(int(sys.argv[2])):
    litter()
    x, _ = collate(ds.__getitems__(np.sort(rng.choice(len(ds), 64, replace=False))))
print("read", flush=True)
"""


def test_garbage_collected_in_another_thread_never_deadlocks_a_read(s3: Any, local: Path, tmp_path: Path) -> None:
    """h5py holds its global lock while it calls the file object, and frees an h5py object only
    under that lock: a read that waited on a service thread (fsspec's event loop) deadlocked as
    soon as that thread's garbage collection reached an h5py object in a reference cycle (h5py
    issue 2019; seen in CI as a read that never ended). Reads run in the reading thread."""
    url = upload(s3, local, "gc/train.h5")
    script = tmp_path / "litter.py"
    script.write_text(_GC_LITTER)
    process = subprocess.Popen([sys.executable, str(script), url, "150"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output = output_or_kill(process, 60, "150 remote reads beside cyclic garbage did not end (a deadlock)")
    assert process.returncode == 0 and output.rstrip().endswith("read"), output[-3000:]


_FORK_AND_READ = """
import gc, os, sys, warnings
import numpy as np
import h5serve.hdf5.remote as remote
from h5serve.client import SharedH5Dataset, collate
warnings.simplefilter("ignore", RuntimeWarning)
remote.BLOCK_BYTES, remote.CACHE_BLOCKS = 4096, 2  # every read a request or more
ds = SharedH5Dataset(sys.argv[1], "x", "y", mode="global", cache_bytes=0, fallback="lazy")
rows = lambda at: collate(ds.__getitems__(np.arange(at, at + 50)))
rows(0)
for child in range(3):
    pid = os.fork()
    if pid == 0:  # reads with a loop of its own, drops the one it inherited, and exits as a script does
        rows(1000)
        gc.collect()
        sys.exit(0)
    assert os.waitpid(pid, 0)[1] == 0, "the child failed"
    rows(2000 + child * 300)  # the parent's loop still wakes for its own requests
print("read", flush=True)
"""


def test_a_forked_child_reading_leaves_the_parents_reads_working(s3: Any, local: Path, tmp_path: Path) -> None:
    """Each process reads on a loop of its own: forked children that read (a loop of their own
    beside the one they inherited) and exit as scripts do never stop the parent's next read, and
    no process reports a connection left open at exit (aiohttp's "Unclosed client session")."""
    url = upload(s3, local, "fork/train.h5")
    script = tmp_path / "fork_read.py"
    script.write_text(_FORK_AND_READ)
    # a host name, not an address: resolving it wakes the loop from a thread (its wake-up pipe)
    by_name = os.environ["AWS_ENDPOINT_URL"].replace("127.0.0.1", "localhost")
    process = subprocess.Popen([sys.executable, str(script), url], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True, env={**os.environ, "AWS_ENDPOINT_URL": by_name})
    output = output_or_kill(process, 60, "reads around 3 forked readers did not end (a parent's loop broken)")
    assert process.returncode == 0 and output.rstrip().endswith("read"), output[-3000:]
    assert "Unclosed" not in output  # every process closed its connections at exit, quietly


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["503", "reset"])
def test_throttling_and_resets_are_retried_then_named(faulty: FaultyProxy, s3: Any, local: Path, kind: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import h5serve.hdf5.remote as remote

    url = upload(s3, local, f"faulty-{kind}/train.h5")
    here = opened(local, mode="global", cache_bytes=0)
    ds = opened(url, mode="global", cache_bytes=0)
    # 3 faults, fewer than the tries: every read succeeds, with h5py's bytes. Tries to spare: in CI
    # (2 of 3 runs, never alone or with this file) requests through this in-process proxy and moto
    # took more than 5 s, and 60 s once, late in the suite; faulty.slow names them if it happens again
    monkeypatch.setattr(remote, "RETRY", remote.RetryPolicy(attempts=12, first_s=0.01, cap_s=0.05, deadline_s=200))
    faulty.kind, faulty.faults = kind, 3
    try:
        got = rows_at(ds, np.arange(ROWS - 200, ROWS))
    except ObjectStoreError as exc:
        pytest.fail(f"3 faults failed the read: {exc}; requests the proxy took more than 2 s over: {faulty.slow}")
    for a, b in zip(got, rows_at(here, np.arange(ROWS - 200, ROWS))):
        np.testing.assert_array_equal(a, b)
    assert faulty.spoiled == 3
    monkeypatch.setattr(remote, "RETRY", remote.RetryPolicy(attempts=4, first_s=0.01, cap_s=0.05, deadline_s=20))
    faulty.faults = 1000  # the store keeps failing: an error naming the URL (and the status), after 4 tries
    with pytest.raises(ObjectStoreError) as info:
        rows_at(ds, np.arange(0, 200))
    # the policy ends the tries at its 4 attempts or at its 20 s deadline, whichever comes first
    # (a reset try can take several seconds on a loaded machine: CI saw 3 tries in 20 s)
    assert url in str(info.value) and re.search(r"after [234] tries", str(info.value)) and info.value.url == url
    if kind == "503":
        assert info.value.status == 503 and "SlowDown" in str(info.value)
    assert SECRET not in messages(info.value)
