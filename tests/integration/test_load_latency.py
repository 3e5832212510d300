"""What a load costs beyond copying its rows: waiting for a loader to start, and for the client
to notice the segment.

- A segment is reserved in a thread while the loader and its part processes get ready
  (daemon/loading/reserve.py): a full /dev/shm is still a ShmFull, with every part process stopped
  and nothing left behind.
- A spare loader (daemon/loading/spare.py) waits for the next load: the load runs in it; the next
  spare is started; spares die with the daemon (SIGKILL or ``h5serve stop``); a waiting
  spare has taken its own copies of the pages it shared with the forkserver.
- A client waiting for a load attaches when the segment is published, not at its next poll.
  ``PublishWatch`` (wire/arrival.py) on a real directory of /dev/shm: a name renamed into
  it ends a wait at once; other names do not; a name already there has arrived.
- End to end: a real daemon and loader; the loader is stopped mid-load (SIGSTOP) while a client
  waits with a poll pause of a minute, then continued: the client is ready within seconds,
  so it was woken by the publication (before, it slept the whole pause).

Every test has a deadline and kills or continues what it stopped.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5serve.client import SharedH5Dataset
from h5serve.daemon.loading import loaderpool
from h5serve.errors import ShmFull
from h5serve.wire import connection
from h5serve.wire.arrival import PublishWatch
from h5serve.wire.connection import DaemonClient
from h5serve.wire.protocol import Acquire, AcquireResult

from ..helpers import Daemon, alive, make_h5, short_workdir, tmpfs, wait_for, writable_shared_dirty_kib
from .test_hangs import find_loader, start_load
from .test_parallel_load import descendants, loaders_of

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    where = Path(tempfile.mkdtemp(prefix="h5s-wake-", dir="/dev/shm"))
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _publish_later(directory: Path, name: str, after: float) -> threading.Thread:
    """Write ``name`` under a temporary name and rename it into place ``after`` seconds from now."""
    def publish() -> None:
        time.sleep(after)
        tmp = directory / f"{name}.tmp-1-x"
        tmp.write_bytes(b"rows")
        os.rename(tmp, directory / name)

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    return thread


def test_a_rename_into_the_dir_ends_the_wait(shm_dir: Path) -> None:
    with PublishWatch(shm_dir, "seg") as watch:
        assert not watch.arrived
        _publish_later(shm_dir, "seg", 0.2)
        started = time.monotonic()
        assert watch.wait(60)
        assert time.monotonic() - started < 30  # woken by the event, not at the end of the pause


def test_a_watch_above_descriptor_1024_still_wakes(shm_dir: Path) -> None:
    """A training process may hold more than 1,024 descriptors (sockets, files, workers'
    pipes): the watch's descriptor lands above select()'s limit and must still be waited on."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1200:
        pytest.skip(f"this process may open only {hard} files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held: list[int] = []
    try:
        for _ in range(5):  # a descriptor this process closes meanwhile (another thread, the GC) leaves a hole
            while not held or held[-1] < 1100:  # opening fills the holes first, then climbs past 1,100
                held.append(os.open("/dev/null", os.O_RDONLY))
            watch = PublishWatch(shm_dir, "seg")
            if watch._fd > 1024:
                break
            watch.close()
            held.append(os.open("/dev/null", os.O_RDONLY))  # takes that hole: the loop climbs again
        with watch:
            assert watch._fd > 1024, watch._fd
            _publish_later(shm_dir, "seg", 0.2)
            started = time.monotonic()
            assert watch.wait(60)
            assert time.monotonic() - started < 30
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_other_names_do_not_end_the_wait(shm_dir: Path) -> None:
    with PublishWatch(shm_dir, "seg") as watch:
        _publish_later(shm_dir, "segment-of-someone-else", 0).join(10)
        started = time.monotonic()
        assert not watch.wait(0.3)
        assert time.monotonic() - started >= 0.3
        assert not watch.arrived


def test_a_name_published_before_the_watch_has_arrived(shm_dir: Path) -> None:
    _publish_later(shm_dir, "seg", 0).join(10)
    with PublishWatch(shm_dir, "seg") as watch:
        assert watch.arrived and watch.wait(0)


def test_a_watch_on_a_missing_dir_still_sleeps_the_pause(shm_dir: Path) -> None:
    with PublishWatch(shm_dir / "gone", "seg") as watch:  # no inotify watch: plain sleeps
        started = time.monotonic()
        assert not watch.wait(0.2)
        assert time.monotonic() - started >= 0.2


def _write_big(path: Path, rows: int = 8192, row_shape: tuple[int, ...] = (3, 64, 64)) -> Path:
    """~100 MB of uncompressed rows: a load long enough to be caught and stopped."""
    with h5py.File(path, "w") as f:
        x = f.create_dataset("x", (rows, *row_shape), dtype="uint8", chunks=(64, *row_shape))
        for a in range(0, rows, 1024):
            x[a:a + 1024] = np.full((min(1024, rows - a), *row_shape), a // 1024, dtype=np.uint8)
    return path


def _acquire_in_thread(client: DaemonClient, request: Acquire) -> tuple[threading.Thread, list[object]]:
    """``client.acquire(request)`` in a thread; the list gets its result or its exception."""
    got: list[object] = []

    def wait() -> None:
        try:
            got.append(client.acquire(request))
        except BaseException as exc:  # noqa: BLE001 - reported by the caller's assertions
            got.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    return waiter, got


@dataclass
class _StoppedLoad:
    """A daemon whose loader of ``request`` is SIGSTOPped mid-load, and a client of it."""

    client: DaemonClient
    request: Acquire
    loader: int
    running: bool = False

    def resume(self) -> None:
        if not self.running:
            self.running = True
            try:
                os.kill(self.loader, signal.SIGCONT)
            except ProcessLookupError:
                pass


@contextlib.contextmanager
def _stopped_load(work: Path) -> Iterator[_StoppedLoad]:
    """A ~100 MB load on a fresh daemon, its loader stopped; resumed and the daemon stopped on exit."""
    path = _write_big(work / "big.h5")
    d = Daemon("--load-processes", "1", "--keep-page-cache")
    load: _StoppedLoad | None = None
    try:
        d.start()
        request = Acquire(str(path), "x", 1, 0)
        with DaemonClient(d.runtime_dir, timeout=10) as client:
            start_load(client, request)
            stopped, tmp = find_loader(d, 10)
            os.kill(stopped, signal.SIGSTOP)
            load = _StoppedLoad(client, request, stopped)
            assert tmp.exists(), "the load finished before it could be stopped: make the file bigger"
            yield load
    finally:
        if load is not None:
            load.resume()
        d.stop()


def test_a_waiting_client_is_ready_when_the_segment_is_published(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connection, "poll_pause", lambda waited: 60.0)  # a poll a minute: only the watch can wake it
    with short_workdir("h5s-wake-") as work, _stopped_load(work) as load:
        waiter, got = _acquire_in_thread(load.client, load.request)
        time.sleep(0.3)  # the client has asked, heard "loading" and is in its minute-long pause
        assert not got, got
        load.resume()
        continued = time.monotonic()
        waiter.join(30)
        assert got and isinstance(got[0], AcquireResult), got
        assert got[0].state == "ready"
        assert time.monotonic() - continued < 30  # not the 60 s pause


def spares_of(daemon_pid: int) -> list[int]:
    """The daemon's spare loaders: its descendants named h5serve-spare."""
    found = []
    for pid in descendants(daemon_pid):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "h5serve-spare":
                    found.append(pid)
        except OSError:
            pass
    return found


def test_the_next_load_runs_in_the_spare_loader() -> None:
    with short_workdir("h5s-spare-") as work:
        small, big = make_h5(work / "small.h5"), _write_big(work / "big.h5")
        d = Daemon("--load-processes", "1")
        try:
            d.start()
            with DaemonClient(d.runtime_dir, timeout=10) as client:
                assert client.acquire(Acquire(str(small), "x", 1, 0)).state == "ready"  # the forkserver is warm
                assert wait_for(lambda: len(spares_of(d.pid)) == 1, 10), descendants(d.pid)
                (spare,) = spares_of(d.pid)
                start_load(client, Acquire(str(big), "x", 1, 0))
                loader, _ = find_loader(d, 10)
                assert loader == spare  # the load runs in the spare, renamed
                with open(f"/proc/{loader}/comm") as f:
                    assert f.read().strip() == "h5serve-load"
                assert client.acquire(Acquire(str(big), "x", 1, 0)).state == "ready"
                assert wait_for(lambda: len(spares_of(d.pid)) == 1 and spares_of(d.pid) != [spare], 10)
        finally:
            d.stop()


@contextlib.contextmanager
def _daemon_after_a_load(work: Path) -> Iterator[Daemon]:
    """A daemon (one loader process a load) that has loaded a small file: its forkserver is warm."""
    small = make_h5(work / "small.h5")
    d = Daemon("--load-processes", "1")
    try:
        d.start()
        with DaemonClient(d.runtime_dir, timeout=10) as client:
            assert client.acquire(Acquire(str(small), "x", 1, 0)).state == "ready"
        yield d
    finally:
        d.stop()


def _threads_and_environ(pid: int) -> tuple[int, bytes]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return len(os.listdir(f"/proc/{pid}/task")), f.read()


def test_the_daemon_and_its_forkserver_start_no_blas_threads() -> None:
    """numpy's OpenBLAS would start a thread per core in each, spinning ~0.1 s at start."""
    with short_workdir("h5s-blas-") as work, _daemon_after_a_load(work) as d:
        _, environ = _threads_and_environ(d.pid)
        assert b"OPENBLAS_NUM_THREADS=1\0" in environ
        servers = [p for p, parent in descendants(d.pid).items() if parent == d.pid
                   and b"forkserver" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert servers, descendants(d.pid)
        for pid in servers:
            assert _threads_and_environ(pid)[0] == 1  # numpy and h5py imported, no thread started


def test_a_waiting_spare_shares_no_written_pages_with_the_forkserver() -> None:
    """A load's first writes would each copy a page the spare shares with the forkserver, and
    with its reservation thread running each copy interrupts the other core: the spare takes
    its copies while it waits (~20 MB shared without that)."""
    with short_workdir("h5s-spare-") as work, _daemon_after_a_load(work) as d:
        assert wait_for(lambda: len(spares_of(d.pid)) == 1, 10), descendants(d.pid)
        (spare,) = spares_of(d.pid)
        assert wait_for(lambda: writable_shared_dirty_kib(spare) < 256, 10), writable_shared_dirty_kib(spare)
        big = _write_big(work / "big.h5", rows=256)
        with DaemonClient(d.runtime_dir, timeout=10) as client:  # and it still loads
            assert client.acquire(Acquire(str(big), "x", 1, 0)).state == "ready"


def test_no_spare_starts_beside_a_running_load() -> None:
    """A spare forked while a load runs takes a core from it: the next one waits for the loads."""
    with short_workdir("h5s-spare-") as work:
        small, big = make_h5(work / "small.h5"), _write_big(work / "big.h5")
        d = Daemon("--load-processes", "1")
        stopped = 0
        try:
            d.start()
            with DaemonClient(d.runtime_dir, timeout=10) as client:
                assert client.acquire(Acquire(str(small), "x", 1, 0)).state == "ready"
                assert wait_for(lambda: len(spares_of(d.pid)) == 1, 10), descendants(d.pid)
                start_load(client, Acquire(str(big), "x", 1, 0))
                stopped, tmp = find_loader(d, 10)  # the load took the spare
                os.kill(stopped, signal.SIGSTOP)
                assert tmp.exists(), "the load finished before it could be stopped: make the file bigger"
                # the daemon's loop goes round every few ms: ten times SPARE_AFTER_LOAD_S and more
                assert not wait_for(lambda: spares_of(d.pid), 10 * loaderpool.SPARE_AFTER_LOAD_S)
                os.kill(stopped, signal.SIGCONT)
                stopped = 0
                assert client.acquire(Acquire(str(big), "x", 1, 0)).state == "ready"
                assert wait_for(lambda: len(spares_of(d.pid)) == 1, 10), descendants(d.pid)
        finally:
            if stopped:
                os.kill(stopped, signal.SIGCONT)
            d.stop()


def test_a_watched_load_is_polled_gently(monkeypatch: pytest.MonkeyPatch) -> None:
    """While inotify waits for the segment's name, the client asks the daemon about every
    WATCHED_POLL_S (progress, a failed load), not every few ms, and still returns at once."""
    asked: list[float] = []
    request_by = DaemonClient.request_by

    def counted(self: DaemonClient, *args: object, **kwargs: object) -> object:
        asked.append(time.monotonic())
        return request_by(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(DaemonClient, "request_by", counted)
    with short_workdir("h5s-gentle-") as work, _stopped_load(work) as load:
        asked.clear()
        waiter, got = _acquire_in_thread(load.client, load.request)
        time.sleep(1.0)
        polls = len(asked)
        # every WATCHED_POLL_S once the first reply named the segment; ~45 polls a
        # second at the short pauses without the watch (measured)
        assert 2 <= polls <= 1.0 / connection.WATCHED_POLL_S + 4, asked
        load.resume()
        waiter.join(30)
        assert got and isinstance(got[0], AcquireResult) and got[0].state == "ready", got


@pytest.mark.parametrize("how", ["kill -9", "h5serve stop"])
def test_a_spare_loader_goes_with_the_daemon(how: str) -> None:
    with short_workdir("h5s-spare-") as work, _daemon_after_a_load(work) as d:
        assert wait_for(lambda: len(spares_of(d.pid)) == 1, 10), descendants(d.pid)
        tree = list(descendants(d.pid))
        if how == "kill -9":
            os.kill(d.pid, signal.SIGKILL)
        else:
            d.stop()
        assert wait_for(lambda: not any(alive(p) for p in tree), 10), [p for p in tree if alive(p)]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_split_load_into_a_full_shm_is_shm_full_and_leaves_nothing() -> None:
    with tmpfs("2m") as mnt, short_workdir("h5s-full-") as work:
        d = Daemon("--shm-dir", str(mnt), "--max-memory", "1G", "--load-processes", "3")
        d.env["H5SERVE_MIN_PART_BYTES"] = str(1 << 20)  # 6 MiB of rows: three parts
        try:
            d.start()
            path = work / "big.h5"
            with h5py.File(path, "w") as f:
                f.create_dataset("x", data=np.ones((6144, 1024), dtype=np.uint8), chunks=(256, 1024))
            with pytest.raises(ShmFull, match=r"needs 6\.0 MiB, .* free"):
                SharedH5Dataset(path, "x", runtime_dir=d.runtime_dir, fallback="error", timeout=30)
            assert wait_for(lambda: not loaders_of(d.pid), 10), descendants(d.pid)
            assert os.listdir(mnt) == []  # the failed temporary was removed
            assert d.status()["running"] is True
        finally:
            d.stop()
