"""Reliability against real processes: kill -9 of the daemon mid-load and of clients holding
segments (DataLoader workers included), a source rewritten under a held segment, 64 clients
asking at once, 10,000 malformed frames, a 10,000-cycle soak, and a daemon that dies while
clients wait.

Three tests are regressions for bugs these tests found: loaders outliving a SIGKILLed daemon,
temporaries kept for a reused (or zombie) pid at restart, and protocol-error replies that lost
the request id.

No mocks: every test starts a real daemon with ``h5serve start`` and real client processes,
has a deadline, and kills everything it started in ``finally`` (fixture teardown), including
whole process groups and the daemon's forkserver and loaders; segment files left in
/dev/shm by a killed daemon are removed too.

``pytest -s`` prints the measured figures; with H5SERVE_RELIABILITY_FIGURES=/path.json they
are also written there (merged, one section per test) for the docs to quote.
"""

from __future__ import annotations

import functools
import gc
import json
import multiprocessing
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import h5py
import msgpack
import numpy as np
import pytest
import zmq

from h5serve.client import SharedH5Dataset
from h5serve.errors import BudgetExceeded, ProtocolError
from h5serve.segments import attach_segment, read_progress, temporary_owner_pid
from h5serve.wire.connection import DaemonClient
from h5serve.wire.protocol import MAX_FRAME_BYTES, Acquire, AcquireResult, Status

from ..helpers import Daemon, alive, descendant_pids, make_h5, short_tmpdir, temporary_prefix, wait_for

pytestmark = pytest.mark.slow

# ----- data -------------------------------------------------------------------------------
# Patterned rows, gzip-compressed, written with write_direct_chunk: writing costs one zlib
# pass per chunk *variant* (eight of them), loading decompresses every chunk. So a 600 MiB
# shard is written in well under a second and takes about 1.5-2.5 s to load on this machine.
N_VARIANTS = 8
BIG_ROW_SHAPE = (64, 64, 3)  # 12 KiB rows
BIG_CHUNK_ROWS = 256
BIG_ROWS = 51200  # 600 MiB of uint8
MID_ROW_SHAPE = (32, 32, 3)
MID_CHUNK_ROWS = 256
MID_ROWS = 8192  # 24 MiB


@functools.cache
def chunk_variants(row_shape: tuple[int, ...], chunk_rows: int) -> np.ndarray:
    """(N_VARIANTS, chunk_rows, *row_shape) uint8: a smooth ramp plus 1-bit seeded noise,
    compressible (about 2.6x with gzip) but not trivial."""
    base = np.arange(chunk_rows * int(np.prod(row_shape)), dtype=np.int64).reshape(chunk_rows, *row_shape) // 7
    out = np.empty((N_VARIANTS, chunk_rows, *row_shape), dtype=np.uint8)
    for v in range(N_VARIANTS):
        noise = np.random.default_rng(1000 + v).integers(0, 2, size=base.shape)
        out[v] = ((base + 13 * v) % 251 + noise).astype(np.uint8)
    return out


def write_patterned(path: Path, rows: int, row_shape: tuple[int, ...], chunk_rows: int) -> Path:
    """x: rows of chunk_variants (chunk i holds variant i % N_VARIANTS), gzip; y: arange."""
    assert rows % chunk_rows == 0
    variants = chunk_variants(row_shape, chunk_rows)
    compressed = [zlib.compress(v.tobytes(), 6) for v in variants]
    with h5py.File(path, "w") as f:
        d = f.create_dataset("x", shape=(rows, *row_shape), dtype="uint8", chunks=(chunk_rows, *row_shape),
                             compression="gzip")
        for i in range(rows // chunk_rows):
            d.id.write_direct_chunk((i * chunk_rows,) + (0,) * len(row_shape), compressed[i % N_VARIANTS])
        f.create_dataset("y", data=np.arange(rows, dtype=np.int64))
    return path


def patterned_rows(rows: Any, row_shape: tuple[int, ...], chunk_rows: int) -> np.ndarray:
    """The expected x rows, computed from the generator (not read back through h5py)."""
    idx = np.asarray(rows, dtype=np.int64)
    return chunk_variants(row_shape, chunk_rows)[(idx // chunk_rows) % N_VARIANTS, idx % chunk_rows]


def patterned_crc(rows: int, row_shape: tuple[int, ...], chunk_rows: int) -> int:
    """crc32 of the whole x dataset, streamed chunk by chunk from the generator."""
    variants = chunk_variants(row_shape, chunk_rows)
    crc = 0
    for i in range(rows // chunk_rows):
        crc = zlib.crc32(variants[i % N_VARIANTS], crc)
    return crc


def h5_read(path: Path, key: str) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f[key][...]


# ----- processes --------------------------------------------------------------------------
def open_files(pid: int) -> list[str]:
    out = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return out


def vm_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def record_figures(section: str, values: dict[str, Any]) -> None:
    """Print measured figures (pytest -s) and merge them into $H5SERVE_RELIABILITY_FIGURES."""
    print(f"\n[h5serve reliability] {section}: {json.dumps(values, sort_keys=True)}")
    path = os.environ.get("H5SERVE_RELIABILITY_FIGURES")
    if path:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            data = {}
        data[section] = values
        Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


class Reaper:
    """Everything a test starts, killed and removed in teardown (the fixture's finally)."""

    def __init__(self) -> None:
        self.daemons: list[Daemon] = []
        self.daemon_pids: list[int] = []
        self.procs: list[subprocess.Popen] = []
        self.dirs: list[Path] = []
        self.clients: list[DaemonClient] = []
        self.closables: list[Any] = []

    def daemon(self, *extra: str) -> Daemon:
        d = Daemon(*extra)
        self.daemons.append(d)
        return d

    def start(self, d: Daemon) -> Daemon:
        d.start()
        self.daemon_pids.append(d.pid)
        return d

    def tmpdir(self, prefix: str) -> Path:
        path = short_tmpdir(prefix)
        self.dirs.append(path)
        return path

    def client(self, d: Daemon, timeout: float = 5.0) -> DaemonClient:
        c = DaemonClient(d.runtime_dir, timeout=timeout)
        self.clients.append(c)
        return c

    def keep(self, obj: Any) -> Any:
        self.closables.append(obj)
        return obj

    def python(self, script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """A python child in its own session (so its whole tree can be killed by group)."""
        p = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(script), *args], env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        )
        self.procs.append(p)
        return p

    def cleanup(self) -> None:
        for obj in self.closables:
            try:
                obj.close()
            except Exception as exc:  # noqa: BLE001 - the rest of the cleanup must still run
                print(f"cleanup: closing {obj!r} failed: {exc}")
        for c in self.clients:
            c.close()
        for p in self.procs:
            _killpg(p.pid)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            for stream in (p.stdout, p.stderr):
                if stream is not None:
                    stream.close()
        for d in self.daemons:
            try:
                d.stop()  # graceful if alive (unlinks its segments), SIGKILL otherwise; removes its dir
            finally:
                # the daemon is a session leader: its group holds its forkserver and loaders
                for pid in self.daemon_pids:
                    _killpg(pid)
                wait_for(lambda: not any(alive(p) for p in self.daemon_pids), 5)
                for name in d.segment_files():  # left by a SIGKILLed daemon
                    try:
                        os.unlink(f"/dev/shm/{name}")
                    except FileNotFoundError:
                        pass
        for path in self.dirs:
            shutil.rmtree(path, ignore_errors=True)


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@pytest.fixture
def reaper() -> Iterator[Reaper]:
    r = Reaper()
    try:
        yield r
    finally:
        r.cleanup()


@pytest.fixture(scope="module")
def big_h5() -> Iterator[Path]:
    where = short_tmpdir("h5s-big-")
    try:
        t = time.monotonic()
        path = write_patterned(where / "big.h5", BIG_ROWS, BIG_ROW_SHAPE, BIG_CHUNK_ROWS)
        print(f"\n[h5serve reliability] wrote {path} ({path.stat().st_size / 2**20:.0f} MiB on disk, "
              f"{BIG_ROWS * int(np.prod(BIG_ROW_SHAPE)) / 2**20:.0f} MiB of rows) in {time.monotonic() - t:.2f}s")
        yield path
    finally:
        shutil.rmtree(where, ignore_errors=True)


def read_json_line(proc: subprocess.Popen, timeout: float) -> dict[str, Any]:
    """The next JSON line a child prints, or a clear failure (never blocks past ``timeout``)."""
    buf: bytes = getattr(proc, "_h5_buf", b"")
    deadline = time.monotonic() + timeout
    fd = proc.stdout.fileno()
    while b"\n" not in buf:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"child {proc.pid} printed no line within {timeout:g}s (so far {buf[-500:]!r})")
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                try:
                    err = proc.communicate(timeout=5)[1]
                except subprocess.TimeoutExpired:
                    err = b"(still running)"
                raise AssertionError(f"child {proc.pid} exited ({proc.poll()}) without a line; stderr:\n"
                                     f"{err.decode(errors='replace')[-3000:]}")
            buf += chunk
    line, rest = buf.split(b"\n", 1)
    proc._h5_buf = rest  # type: ignore[attr-defined]
    return json.loads(line)


def protocol_errors(status: dict[str, Any]) -> int:
    """Error replies with code "protocol", from ``errors`` (by code) or ``counters['errors.protocol']``."""
    if isinstance(status.get("errors"), dict):
        return status["errors"].get("protocol", 0)
    return status["counters"].get("errors.protocol", 0)


def segments_of(client: DaemonClient, path: Path | None = None) -> list[dict[str, Any]]:
    segs = client.status()["segments"]
    return segs if path is None else [s for s in segs if s["file"] == os.path.realpath(path)]


def wait_loading(client: DaemonClient, path: Path, timeout: float) -> dict[str, Any]:
    """Poll status until the segment of ``path`` is loading with rows_done > 0."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for s in segments_of(client, path):
            assert s["state"] != "ready", "the load finished before the test could kill the daemon: make it slower"
            if s["state"] == "loading" and s["rows_done"] > 0:
                return s
        time.sleep(0.02)
    raise AssertionError(f"no load of {path} with rows_done > 0 within {timeout:g}s: {segments_of(client)}")


# A client process: imports, says so, waits for the go file, then builds the dataset (the
# daemon loads) and reports what happened, with wall-clock times to compare with the kill.
WAITING_CLIENT = """
    import json, os, sys, time, warnings, zlib
    args = json.loads(sys.argv[1])
    from h5serve.client import SharedH5Dataset
    from h5serve.errors import DaemonUnavailable
    print(json.dumps({"event": "imported", "pid": os.getpid()}), flush=True)
    if args.get("polling"):  # touch this file once the main thread is in the client's polling loop
        import threading
        main, poller = threading.main_thread().ident, os.path.join("h5serve", "wire", "connection.py")

        def watch():
            end = time.monotonic() + 60
            while time.monotonic() < end:
                frame = sys._current_frames().get(main)
                while frame is not None:
                    if frame.f_code.co_name == "acquire" and frame.f_code.co_filename.endswith(poller):
                        open(args["polling"], "w").close()
                        return
                    frame = frame.f_back
                time.sleep(0.005)

        threading.Thread(target=watch, daemon=True).start()
    deadline = time.monotonic() + 60
    while not os.path.exists(args["go"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.time()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ds = SharedH5Dataset(args["path"], "x", rank=0, world_size=1, fallback=args["fallback"],
                                 timeout=args["timeout"], runtime_dir=args["runtime_dir"], wait_ready=True)
        out = {"outcome": "dataset", "backend": ds.backend, "t0": t0, "t": time.time(), "len": len(ds),
               "warnings": [str(w.message)[:300] for w in caught]}
        batch = ds.__getitems__(args["rows"])
        out["rows_crc"] = zlib.crc32(batch.x.numpy().tobytes())
        ds.close()
    except DaemonUnavailable as exc:
        out = {"outcome": "DaemonUnavailable", "message": str(exc)[:300], "t0": t0, "t": time.time()}
    print(json.dumps(out), flush=True)
"""

PROBE_ROWS = [0, 1, 255, 256, 4097, 25_000, BIG_ROWS // 2 + 3, BIG_ROWS - 1]


def _loader_pids(daemon_pid: int, tmp_marker: str) -> tuple[list[int], list[int]]:
    """(every descendant of the daemon, those with the temporary segment open: the loaders)."""
    tree = descendant_pids(daemon_pid)
    loaders = [p for p in tree if any(tmp_marker in f for f in open_files(p))]
    return tree, loaders


# ----- 1. kill -9 the daemon in the middle of a large load ---------------------------------
def _kill_daemon_mid_load(d: Daemon, c: DaemonClient, big: Path, group: bool = False) -> dict[str, Any]:
    """Wait until ``big`` is loading with rows_done > 0, find its loader, SIGKILL the daemon (or,
    with ``group``, its whole process group: daemon, forkserver and loaders, as an OOM kill of the
    service's cgroup or ``kill -9 -PGID`` would)."""
    seg = wait_loading(c, big, 30)
    tree, loaders = _loader_pids(d.pid, temporary_prefix(d))
    assert loaders, f"no process of the daemon's tree {tree} has {temporary_prefix(d)}* open"
    assert any(n.startswith(temporary_prefix(d)) for n in d.segment_files())
    c.close()
    t_kill = time.time()
    if group:
        os.killpg(d.pid, signal.SIGKILL)  # the daemon is its session's (and group's) leader
    else:
        os.kill(d.pid, signal.SIGKILL)
    return {"seg": seg, "name": seg["name"], "tree": tree, "loaders": loaders, "t_kill": t_kill}


@pytest.mark.timeout(90)
def test_kill_daemon_mid_load_loader_dies_with_daemon(reaper: Reaper, big_h5: Path) -> None:
    d = reaper.start(reaper.daemon())
    c = reaper.client(d)
    c.request(Acquire(str(big_h5), "x", 1, 0))  # a raw acquire starts the load; nobody waits for it
    k = _kill_daemon_mid_load(d, c, big_h5)
    t = time.monotonic()
    gone = wait_for(lambda: not any(alive(p) for p in k["loaders"]), 10)
    died_after = time.monotonic() - t
    left = d.segment_files()
    temporaries = [n for n in left if n.startswith(temporary_prefix(d))]
    progress = [read_progress(Path("/dev/shm") / n) for n in temporaries]
    record_figures("kill9_loader", {"loader_gone_after_s": round(died_after, 3), "files_left": left,
                                    "temporary_progress": progress, "rows_done_at_kill": k["seg"]["rows_done"]})
    assert gone, f"loader(s) {k['loaders']} still alive 10s after the daemon was SIGKILLed"
    assert k["name"] not in left, "the interrupted load was published under its final name"
    assert len(temporaries) <= 1 and set(left) == set(temporaries), left
    assert all(done < total for done, total in progress), "the loader finished its rows after the daemon died"
    assert died_after < 3.0, f"the loader took {died_after:.1f}s to die"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("victim", ["daemon", "daemon-group"])
def test_kill_daemon_mid_load(reaper: Reaper, big_h5: Path, victim: str) -> None:
    """SIGKILL of the daemon alone (its loader dies with it, see the test above), or of its
    whole group (the loader surely dies mid-write and leaves its temporary): the waiting client gives up in
    time, the next start removes temporaries,
    adopts complete segments of unchanged sources only, and serves new clients."""
    work = reaper.tmpdir("h5s-k9-")
    keep, change = make_h5(work / "keep.h5"), make_h5(work / "change.h5")
    d = reaper.start(reaper.daemon())
    c = reaper.client(d)
    for f in (keep, change):  # complete segments, to be adopted (or not) after the restart
        c.acquire(Acquire(str(f), "x", 1, 0))
    complete = {s["name"]: s["file"] for s in segments_of(c)}
    assert sorted(complete) == d.segment_files() and len(complete) == 2

    go = work / "go"
    proc = reaper.python(WAITING_CLIENT, json.dumps({
        "path": str(big_h5), "fallback": "error", "timeout": 2.0, "runtime_dir": str(d.runtime_dir),
        "go": str(go), "rows": PROBE_ROWS}))
    read_json_line(proc, 60)  # imported
    go.touch()
    k = _kill_daemon_mid_load(d, c, big_h5, group=victim == "daemon-group")

    # the waiting client raises DaemonUnavailable (fallback="error") within its timeout, no hang
    out = read_json_line(proc, 30)
    assert out["outcome"] == "DaemonUnavailable", out
    assert out["t"] - k["t_kill"] < 2.0 + 1.5, f"client gave up {out['t'] - k['t_kill']:.2f}s after the kill"
    assert proc.wait(timeout=10) == 0

    # every process of the dead daemon is gone (loaders included, see the test above), and
    # the daemon itself is reaped: this machine's PID 1 reaps orphans only every 1-2 s, and a
    # zombie's pid still "exists" for recovery (see test_restart_removes_temporaries_of_a_reused_pid)
    assert wait_for(lambda: not any(alive(p) for p in k["tree"]), 15), \
        [p for p in k["tree"] if alive(p)]
    assert wait_for(lambda: not os.path.exists(f"/proc/{d.pid}"), 15), "the killed daemon was never reaped"
    left = d.segment_files()
    temporaries = [n for n in left if temporary_owner_pid(n) is not None]
    assert set(complete) <= set(left)
    assert set(left) - set(complete) - set(temporaries) <= {k["name"]}
    assert all(n.startswith(temporary_prefix(d)) for n in temporaries), left
    if victim == "daemon-group":  # killed mid-write: a temporary, never the final name
        assert len(temporaries) == 1 and k["name"] not in left, left

    # while it is down, one source changes: its segment must not be adopted
    make_h5(change, rows=500)
    adoptable = sorted(n for n in left
                       if temporary_owner_pid(n) is None and complete.get(n) != os.path.realpath(change))

    reaper.start(d)  # same runtime dir
    status = d.status()
    assert status["pid"] == d.pid and status["counters"].get("adopted") == len(adoptable), status["counters"]
    assert d.segment_files() == adoptable, "temporaries or changed-source segments survived the restart"
    assert sorted(s["name"] for s in status["segments"]) == adoptable
    assert {s["state"] for s in status["segments"]} == {"ready"}

    kept_name = next(n for n, f in complete.items() if f == os.path.realpath(keep))
    assert kept_name in adoptable
    loads_before = status["counters"].get("loads", 0)
    ds = reaper.keep(SharedH5Dataset(keep, "x", rank=0, world_size=1, runtime_dir=d.runtime_dir,
                                     fallback="error"))
    assert ds.backend == "shm"
    assert ds.__getitems__(list(range(len(ds)))).x.numpy().tobytes() == h5_read(keep, "x").tobytes()
    counters = d.status()["counters"]
    assert counters.get("loads", 0) == loads_before == 0, counters  # attached the adopted segment
    assert counters.get("hits", 0) == 1

    # the restarted daemon serves new clients: the changed file, with its new rows
    ds2 = reaper.keep(SharedH5Dataset(change, "x", "y", rank=1, world_size=2, runtime_dir=d.runtime_dir,
                                      fallback="error"))
    assert ds2.backend == "shm" and len(ds2) == 250
    assert ds2.__getitems__(list(range(250))).x.numpy().tobytes() == h5_read(change, "x")[250:].tobytes()
    record_figures(f"kill9_mid_load[{victim}]", {
        "client_error_after_kill_s": round(out["t"] - k["t_kill"], 3), "rows_done_at_kill": k["seg"]["rows_done"],
        "rows_total": k["seg"]["rows"], "files_left_by_dead_daemon": len(left),
        "temporaries_removed_at_restart": len(temporaries), "adopted": len(adoptable)})


@pytest.mark.timeout(90)
def test_restart_removes_temporaries_of_a_reused_pid(reaper: Reaper, big_h5: Path) -> None:
    d = reaper.start(reaper.daemon())
    c = reaper.client(d)
    c.request(Acquire(str(big_h5), "x", 1, 0))
    k = _kill_daemon_mid_load(d, c, big_h5, group=True)  # the loader dies mid-write, for sure
    assert wait_for(lambda: not any(alive(p) for p in k["tree"]), 10)
    assert wait_for(lambda: not os.path.exists(f"/proc/{d.pid}"), 15), "the killed daemon was never reaped"
    (tmp,) = d.segment_files()
    assert tmp.startswith(temporary_prefix(d) + f"{d.pid}-")
    # the dead daemon's pid now belongs to a live process that is no loader: here PID 1 (as when
    # the daemon itself ran as PID 1 of a container sharing /dev/shm, and is started again)
    reused = tmp.replace(f"-tmp-{d.pid}-", "-tmp-1-")
    os.rename(f"/dev/shm/{tmp}", f"/dev/shm/{reused}")
    reaper.start(d)
    assert d.segment_files() == [], "a temporary of the dead daemon survived the restart"


# ----- 2. kill -9 clients holding segments, DataLoader workers included -------------------
HOLDER_WITH_WORKERS = """
    import gc, json, os, sys, time
    args = json.loads(sys.argv[1])
    from torch.utils.data import DataLoader
    from h5serve.client import SharedH5Dataset, collate
    ds = SharedH5Dataset(args["path"], "x", rank=0, world_size=2, fallback="error", runtime_dir=args["runtime_dir"])
    assert ds.backend == "shm", ds.backend
    loader = DataLoader(ds, batch_size=256, num_workers=2, multiprocessing_context="fork",
                        persistent_workers=True, collate_fn=collate, timeout=60)
    rows = sum(len(x) for x in loader)
    ds.close()  # from now on only the two forked workers hold the segment (and its lease)
    gc.collect()
    print(json.dumps({"rows": rows, "len": len(ds)}), flush=True)
    time.sleep(600)  # the workers hold the segment until the test kills them
"""


@pytest.mark.timeout(120)
def test_killed_clients_release_leases(reaper: Reaper) -> None:
    work = reaper.tmpdir("h5s-hold-")
    rows, row_shape = 4096, (32, 32, 3)
    path = make_h5(work / "data.h5", rows=rows, row_shape=row_shape)
    shard_bytes = 4096 + rows // 2 * int(np.prod(row_shape))  # header + one shard of uint8 rows
    budget = shard_bytes + shard_bytes // 2  # one shard fits, two do not
    d = reaper.start(reaper.daemon("--max-memory", str(budget)))
    c = reaper.client(d)

    child = reaper.python(HOLDER_WITH_WORKERS, json.dumps({"path": str(path), "runtime_dir": str(d.runtime_dir)}))
    ready = read_json_line(child, 90)
    assert ready["rows"] == ready["len"] == rows // 2
    (seg_a,) = segments_of(c)
    assert seg_a["rank"] == 0 and seg_a["bytes"] == shard_bytes
    workers = descendant_pids(child.pid)
    holders = [p for p in workers if any(f.endswith("/" + seg_a["name"]) for f in open_files(p))]
    assert len(holders) >= 2, f"the DataLoader workers {workers} do not hold {seg_a['name']}"
    assert not any(f.endswith("/" + seg_a["name"]) for f in open_files(child.pid)), \
        "SharedH5Dataset.close() left the segment open in the main process"

    with pytest.raises(BudgetExceeded):
        SharedH5Dataset(path, "x", rank=1, world_size=2, runtime_dir=d.runtime_dir, fallback="error")
    assert c.status()["counters"].get("refusals", 0) >= 1
    assert d.segment_files() == [seg_a["name"]]  # held: not evicted

    os.killpg(child.pid, signal.SIGKILL)
    child.wait(timeout=10)
    assert wait_for(lambda: not any(alive(p) for p in workers), 10), "DataLoader workers survived SIGKILL"
    # the kernel drops the dead processes' leases: the daemon sees no holder left on A
    assert wait_for(lambda: [x["holders"] for x in segments_of(c) if x["name"] == seg_a["name"]] == [0], 10), \
        segments_of(c)

    ds_b = reaper.keep(SharedH5Dataset(path, "x", rank=1, world_size=2, runtime_dir=d.runtime_dir,
                                       fallback="error"))
    assert ds_b.backend == "shm"
    assert ds_b.__getitems__(list(range(len(ds_b)))).x.numpy().tobytes() == h5_read(path, "x")[rows // 2:].tobytes()
    status = d.status()
    assert status["counters"].get("evictions", 0) >= 1, status["counters"]
    names = sorted(s["name"] for s in status["segments"])
    assert seg_a["name"] not in names and len(names) == 1
    assert d.segment_files() == names, "files under the daemon's prefix differ from its segments"
    assert status["memory"]["used"] == shard_bytes <= status["memory"]["budget"]


# ----- 3. the source is rewritten while a segment of it is held ----------------------------
@pytest.mark.timeout(90)
def test_rewritten_file_marks_held_segment_stale_and_evicts_it_once_released(reaper: Reaper) -> None:
    work = reaper.tmpdir("h5s-rw-")
    path = make_h5(work / "data.h5")
    old_x, old_y = h5_read(path, "x"), h5_read(path, "y")
    d = reaper.start(reaper.daemon())
    c = reaper.client(d)
    holder = reaper.keep(SharedH5Dataset(path, "x", "y", rank=0, world_size=1, runtime_dir=d.runtime_dir,
                                         fallback="error"))
    assert holder.backend == "shm"
    old_names = sorted(s["name"] for s in segments_of(c))
    assert len(old_names) == 2

    time.sleep(0.05)  # the new mtime must differ even on coarse timestamps
    new_x, new_y = (old_x.astype(np.int64) + 7) % 251, old_y + 1_000_000
    with h5py.File(path, "w") as f:  # rewritten in place: same inode, new contents
        f.create_dataset("x", data=new_x.astype(np.uint8), chunks=(64, *new_x.shape[1:]))
        f.create_dataset("y", data=new_y)

    fresh = reaper.keep(SharedH5Dataset(path, "x", "y", rank=0, world_size=1, runtime_dir=d.runtime_dir,
                                        fallback="error"))
    assert fresh.backend == "shm"
    all_rows = list(range(len(fresh)))
    got = fresh.__getitems__(all_rows)
    assert got.x.numpy().tobytes() == new_x.astype(np.uint8).tobytes()
    assert got.y.numpy().tolist() == new_y.tolist()
    new_names = sorted({s["name"] for s in segments_of(c)} - set(old_names))
    assert len(new_names) == 2

    # the old segments: still mapped by the holder (old rows), "stale" once the sweep saw the change
    assert wait_for(lambda: {s["name"]: s["state"] for s in segments_of(c) if s["name"] in old_names}
                    == dict.fromkeys(old_names, "stale"), 6), segments_of(c)
    old = holder.__getitems__(all_rows)
    assert old.x.numpy().tobytes() == old_x.tobytes() and old.y.numpy().tolist() == old_y.tolist()
    assert set(old_names) <= set(d.segment_files())  # held: not evicted
    assert c.status()["counters"].get("stale_evictions", 0) == 0

    holder.close()
    t_close = time.monotonic()
    assert wait_for(lambda: not set(old_names) & set(d.segment_files()), 5.5), \
        f"stale segments still in /dev/shm 5.5s after the holder closed: {d.segment_files()}"
    evicted_after = time.monotonic() - t_close
    status = d.status()
    assert status["counters"].get("stale_evictions", 0) >= 2, status["counters"]
    assert sorted(s["name"] for s in status["segments"]) == new_names == d.segment_files()
    assert fresh.__getitems__([0, 999]).y.numpy().tolist() == [1_000_000, 1_000_999]
    record_figures("stale_eviction", {"evicted_after_close_s": round(evicted_after, 3)})


# ----- 4. 64 client processes ask for the same shard at once -------------------------------
def _concurrent_client(barrier: Any, results: Any, index: int, path: str, runtime_dir: str) -> None:
    try:
        barrier.wait()
        t0 = time.monotonic()
        ds = SharedH5Dataset(path, "x", "y", rank=0, world_size=1, runtime_dir=runtime_dir, fallback="error",
                             timeout=30.0)
        waited = time.monotonic() - t0
        crc_x = crc_y = 0
        for start in range(0, len(ds), 2048):
            batch = ds.__getitems__(list(range(start, min(start + 2048, len(ds)))))
            crc_x = zlib.crc32(batch.x.numpy(), crc_x)
            crc_y = zlib.crc32(batch.y.numpy(), crc_y)
        backend = ds.backend
        ds.close()
        results.put((index, backend, crc_x, crc_y, waited, ""))
    except BaseException as exc:  # noqa: BLE001 - reported to the test, not lost in a child's stderr
        results.put((index, "error", 0, 0, 0.0, f"{type(exc).__name__}: {exc}"))


@pytest.mark.timeout(150)
def test_64_clients_load_once(reaper: Reaper) -> None:
    n = 64
    work = reaper.tmpdir("h5s-64-")
    path = write_patterned(work / "mid.h5", MID_ROWS, MID_ROW_SHAPE, MID_CHUNK_ROWS)
    want_x = patterned_crc(MID_ROWS, MID_ROW_SHAPE, MID_CHUNK_ROWS)
    want_y = zlib.crc32(np.arange(MID_ROWS, dtype=np.int64))
    d = reaper.start(reaper.daemon())
    ctx = multiprocessing.get_context("fork")  # no 64 torch imports
    barrier, results = ctx.Barrier(n, timeout=60), ctx.Queue()
    procs = [ctx.Process(target=_concurrent_client, args=(barrier, results, i, str(path), str(d.runtime_dir)),
                         daemon=True) for i in range(n)]
    try:
        t0 = time.monotonic()
        for p in procs:
            p.start()
        got = [results.get(timeout=max(1.0, 120 - (time.monotonic() - t0))) for _ in range(n)]
        elapsed = time.monotonic() - t0
        for p in procs:
            p.join(timeout=max(1.0, 130 - (time.monotonic() - t0)))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        results.close()
    errors = [g for g in got if g[5]]
    assert not errors, errors[:3]
    assert sorted(g[0] for g in got) == list(range(n))
    assert {g[1] for g in got} == {"shm"}
    assert {(g[2], g[3]) for g in got} == {(want_x, want_y)}, "clients got different or wrong bytes"
    status = d.status()
    counters = status["counters"]
    assert counters.get("loads") == 2 and counters.get("loads_requested") == 2, counters
    assert counters.get("load_errors", 0) == 0 and counters.get("hits", 0) >= 2 * n
    assert len(status["segments"]) == 2 and len(d.segment_files()) == 2
    waits = sorted(g[4] for g in got)
    record_figures("concurrent_64", {
        "clients": n, "loads": counters["loads"], "hits": counters["hits"], "wall_s": round(elapsed, 2),
        "load_s": max(s["load_s"] for s in status["segments"]),
        "client_wait_s_min_median_max": [round(waits[0], 3), round(waits[n // 2], 3), round(waits[-1], 3)]})


# ----- 5. malformed frames -----------------------------------------------------------------
def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def malformed_frames(count: int, seed: int) -> list[list[bytes]]:
    """``count`` requests (each a list of frames) that must all get a ``protocol`` error."""
    rng = random.Random(seed)
    acquire = {"v": 1, "id": 7, "op": "acquire", "path": "/tmp/h5s-nowhere.h5", "key": "x", "world_size": 2,
               "rank": 0, "mode": "contiguous", "dtype": None}
    ping = _pack({"v": 1, "id": 1, "op": "ping"})

    def req(**changes: Any) -> bytes:
        m = {**acquire, **changes}
        return _pack({k: v for k, v in m.items() if v is not _DROP})

    fixed: list[bytes | list[bytes]] = [
        b"", b"\xc1", b"\x00", b"\xff",
        # hostile declared lengths: str32, array32, map32, bin32, ext32, array16, map16, str8 of 4 GiB/64 Ki
        b"\xdb\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff",
        b"\xc9\xff\xff\xff\xff\x05", b"\xdc\xff\xff", b"\xde\xff\xff", b"\xd9\xff",
        b"\x83\xa1v\x01\xa2id\x01\xa2op\xdb\xff\xff\xff\xff",
        b"\x84\xa1v\x01\xa2id\x01\xa2op\xa4ping\xa4path\xdd\xff\xff\xff\xff",
        b"\x83\xa1v\x01\xa2id\x01\xa2op\xdf\xff\xff\xff\xff" + b"\xa1a" * 100,
        # nesting
        b"\x91" * 3000 + b"\xc0", b"\x81\xa1a" * 2000 + b"\xc0",
        # large, but within MAX_FRAME_BYTES (larger frames: see OVERSIZE)
        b"\x00" * MAX_FRAME_BYTES, _pack({"v": 1, "id": 1, "op": "status", "pad": list(range(20_000))}),
        _pack({"v": 1, "id": 1, "op": "ping", "pad": "x" * (MAX_FRAME_BYTES - 40)}),
        # not a map
        *[_pack(v) for v in (None, True, 0, -1, 2**63, 1.5, "ping", [], [1, 2, 3], ["v", 1, "op", "ping"])],
        _pack(b"bytes"), _pack(msgpack.ExtType(1, b"xx")), _pack({"v": 1, "id": 1, "op": msgpack.ExtType(2, b"")}),
        # versions
        *[_pack({"v": v, "id": 1, "op": "ping"}) for v in (0, 2, -1, "1", True, None, 1.0, [1], 2**64 - 1)],
        _pack({"id": 1, "op": "ping"}),
        # ids
        *[_pack({"v": 1, "id": i, "op": "ping"}) for i in (-1, 2**63, 2**64 - 1, "1", True, 1.5, None, {}, [])],
        _pack({"v": 1, "op": "ping"}),
        # ops
        *[_pack({"v": 1, "id": 1, "op": op}) for op in ("", "PING", "Ping", "ping ", "acquire\0", "delete",
                                                          "exec", "__class__", "__init__", 1, None, ["ping"], {})],
        _pack({"v": 1, "id": 1}),
        # extra fields (a shutdown with an extra field must not stop the daemon)
        _pack({"v": 1, "id": 1, "op": "shutdown", "now": True}), _pack({"v": 1, "id": 1, "op": "status", "x": 1}),
        _pack({"v": 1, "id": 1, "op": "ping", "op2": "shutdown"}), req(priority=1), req(OP="acquire"),
        # missing fields
        *[req(**{f: _DROP}) for f in ("path", "key", "world_size", "rank")],
        # wrong-typed or out-of-range fields
        *[req(path=v) for v in (1, None, "", "a\0b", "x" * 5000, ["p"], {"p": 1}, True)],
        *[req(key=v) for v in (0, "", "k" * 2000, None, ["x"], 1.5)],
        *[req(world_size=v) for v in ("2", 0, -1, 2**20 + 1, True, 1.5, None, 2**64 - 1, [2])],
        *[req(rank=v) for v in (-1, 2, "0", True, 0.0, None, [0])],
        *[req(mode=v) for v in ("diagonal", "", None, 1, "CONTIGUOUS", ["interleave"])],
        *[req(dtype=v) for v in (1, "", "f" * 40, [], True, {"d": 1})],
        # keys that are not strings
        _pack({1: 1, "v": 1, "id": 1, "op": "ping"}), _pack({None: 1}),
        b"\x83\xc4\x01v\x01\xa2id\x01\xa2op\xa4ping",  # bin key
        # trailing bytes, and every strict prefix of a valid request
        ping + b"\x00", ping + ping, req() + b"\xc0",
        *[req()[:i] for i in range(len(req()))],
        # multipart garbage
        [ping, b""], [b"", ping], [b"a", b"b", b"c"], [ping, ping], [b""] * 5, [b"\xdb\xff\xff\xff\xff", ping],
    ]
    junk_keys = ["v", "id", "op", "path", "key", "world_size", "rank", "mode", "dtype"]
    junk_ops = ["ping", "status", "shutdown", "acquire"]

    def random_value(depth: int = 0) -> Any:
        kind = rng.randrange(9 if depth < 3 else 6)
        return [lambda: rng.randrange(-2**63, 2**64), lambda: rng.random() * 1e6, lambda: None,
                lambda: rng.choice([True, False]), lambda: rng.choice(junk_ops + junk_keys + ["", "\0"]),
                lambda: "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(20))),
                lambda: [random_value(depth + 1) for _ in range(rng.randrange(4))],
                lambda: {rng.choice(junk_keys): random_value(depth + 1) for _ in range(rng.randrange(4))},
                lambda: rng.randrange(0, 3)][kind]()

    frames: list[list[bytes]] = [f if isinstance(f, list) else [f] for f in fixed]
    while len(frames) < count:
        kind = rng.randrange(6)
        if kind == 0:  # random bytes
            frames.append([rng.randbytes(rng.randrange(0, 300))])
        elif kind == 1:  # a map with an unknown field: invalid for every op
            m = {k: random_value() for k in rng.sample(junk_keys, rng.randrange(len(junk_keys)))}
            m["v"], m["op"] = rng.choice([1, 1, 2, "1"]), rng.choice(junk_ops + ["nope"])
            m[rng.choice(["junk", "force", "Path", "world"])] = random_value()
            frames.append([_pack(m)])
        elif kind == 2:  # random msgpack value that is not a map
            value = random_value()
            frames.append([_pack([value] if isinstance(value, dict) else value)])
        elif kind == 3:  # strict prefix of a valid request
            full = req(id=rng.randrange(2**63), path="/" + "p" * rng.randrange(1, 200))
            frames.append([full[:rng.randrange(len(full))]])
        elif kind == 4:  # valid request + trailing garbage
            frames.append([req(id=rng.randrange(2**63)) + rng.randbytes(rng.randrange(1, 20))])
        else:  # multipart
            frames.append([rng.randbytes(rng.randrange(0, 40)) for _ in range(rng.randrange(2, 5))])
    return frames[:count]


_DROP = object()


@pytest.mark.timeout(120)
def test_malformed_frames(reaper: Reaper) -> None:
    n = 10_000
    frames = malformed_frames(n, seed=20240611)
    assert len(frames) == n
    work = reaper.tmpdir("h5s-fuzz-")
    path = make_h5(work / "data.h5")
    d = reaper.start(reaper.daemon())
    checker = reaper.client(d)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"ipc://{d.runtime_dir}/h5serve.sock")

        def exchange(batch: list[list[bytes]]) -> None:
            for parts in batch:
                sock.send_multipart(parts)
            for parts in batch:
                assert sock.poll(10_000, zmq.POLLIN), f"no reply within 10s to {parts[0][:80]!r}"
                reply = msgpack.unpackb(sock.recv(), raw=False)
                assert reply.get("v") == 1 and reply.get("ok") is False and reply.get("code") == "protocol" \
                    and isinstance(reply.get("message"), str), (parts[0][:120], reply)

        window = 50
        exchange(frames[:window])  # warm-up before the baseline
        rss_before = vm_rss_kib(d.pid)
        t0 = time.monotonic()
        for i in range(window, n, window):
            exchange(frames[i:i + window])
        elapsed = time.monotonic() - t0
        rss_after = vm_rss_kib(d.pid)

        # frames over MAX_FRAME_BYTES, each on its own connection: the daemon either answers with a
        # protocol error or drops the peer (ZeroMQ MAXMSGSIZE) without allocating the frame
        oversize = {}
        for size in (MAX_FRAME_BYTES + 1, 1 << 20, 32 << 20):
            big = ctx.socket(zmq.DEALER)
            big.setsockopt(zmq.LINGER, 0)
            big.connect(f"ipc://{d.runtime_dir}/h5serve.sock")
            big.send(b"\xa1" * size)
            if big.poll(1500, zmq.POLLIN):
                reply = msgpack.unpackb(big.recv(), raw=False)
                assert reply.get("ok") is False and reply.get("code") == "protocol", reply
                oversize[size] = "protocol error"
            else:
                oversize[size] = "no reply (peer dropped)"
            big.close()
        rss_oversize = vm_rss_kib(d.pid)
        counted = checker.request(Status(), timeout=10.0, retries=0)

        # clients that send and never read the replies: one disconnects at once, one stays
        gone = ctx.socket(zmq.DEALER)
        gone.setsockopt(zmq.LINGER, 2000)  # flush the requests, then go away
        gone.connect(f"ipc://{d.runtime_dir}/h5serve.sock")
        for i in range(2000):
            gone.send(_pack({"v": 1, "id": i, "op": "status"}))
        gone.close()
        mute = ctx.socket(zmq.DEALER)
        mute.setsockopt(zmq.LINGER, 0)
        mute.connect(f"ipc://{d.runtime_dir}/h5serve.sock")
        for i in range(5000):
            mute.send(_pack({"v": 1, "id": i, "op": "ping"}))
        # and a peer that does not even speak ZMTP
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            raw.connect(str(d.runtime_dir / "h5serve.sock"))
            raw.sendall(random.Random(1).randbytes(65536))
        except OSError:
            pass  # the daemon may hang up first: that is fine
        finally:
            raw.close()
        t_status = time.monotonic()
        status = checker.request(Status(), timeout=10.0, retries=0)
        status_latency = time.monotonic() - t_status
        mute.close()
        sock.close()
    finally:
        ctx.destroy(linger=0)

    assert d.alive() and status["pid"] == d.pid
    answered = sum(v == "protocol error" for v in oversize.values())
    assert protocol_errors(counted) == n + answered, (counted["counters"], counted.get("errors"))
    # (the non-ZMTP peer's bytes may be taken for ZMTP 1.0 frames: more protocol errors, never fewer)
    assert protocol_errors(status) >= protocol_errors(counted)
    assert {k: v for k, v in status["counters"].items() if k != "errors.protocol"} == \
        dict.fromkeys([k for k in status["counters"] if k != "errors.protocol"], 0), status["counters"]
    assert status["segments"] == [] and status["memory"]["used"] == 0
    assert wait_for(lambda: checker.ping()["pid"] == d.pid, 5)
    rss_end = vm_rss_kib(d.pid)
    growth_mib = (max(rss_after, rss_oversize, rss_end) - rss_before) / 1024
    assert growth_mib < 16, f"daemon RSS grew {growth_mib:.1f} MiB over {n} malformed frames"

    ds = reaper.keep(SharedH5Dataset(path, "x", "y", rank=1, world_size=3, runtime_dir=d.runtime_dir,
                                     fallback="error"))
    assert ds.backend == "shm"
    batch = ds.__getitems__(list(range(len(ds))))
    assert batch.x.numpy().tobytes() == h5_read(path, "x")[ds.indices].tobytes()
    assert batch.y.numpy().tolist() == ds.indices.tolist()
    record_figures("malformed_frames", {
        "frames": n, "frames_per_s": round((n - window) / elapsed), "rss_before_kib": rss_before,
        "rss_after_kib": rss_after, "rss_after_oversize_kib": rss_oversize, "rss_end_kib": rss_end,
        "status_latency_s": round(status_latency, 3), "oversize_frames": {str(k): v for k, v in oversize.items()}})


# ----- 6. soak ------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_soak(reaper: Reaper) -> None:
    cycles, warmup = 10_000, 500
    work = reaper.tmpdir("h5s-soak-")
    path = make_h5(work / "data.h5")
    want = h5_read(path, "x")[500:]
    d = reaper.start(reaper.daemon())
    c = reaper.client(d)
    request = Acquire(str(path), "x", 2, 1)
    figures: dict[str, Any] = {}
    my_fds_before = 0
    t0 = time.monotonic()
    for i in range(cycles):
        if i == warmup:
            gc.collect()
            figures.update(fds_before=fd_count(d.pid), rss_before_kib=vm_rss_kib(d.pid))
            my_fds_before = fd_count(os.getpid())
            t_warm = time.monotonic()
        result = AcquireResult.from_wire(c.request(request))
        if result.state != "ready":
            assert i == 0, f"cycle {i}: {result}"
            result = c.acquire(request)
        seg = attach_segment(result.shm_dir, result.name)
        if i % 1000 == 0 or i == cycles - 1:
            assert seg.data.tobytes() == want.tobytes(), f"cycle {i}: wrong bytes"
        else:
            assert seg.data[i % 500, 0, 0, 0] == want[i % 500, 0, 0, 0]
        seg.close()
        del seg
    elapsed = time.monotonic() - t_warm
    gc.collect()
    figures.update(fds_after=fd_count(d.pid), rss_after_kib=vm_rss_kib(d.pid), cycles=cycles, warmup=warmup,
                   cycles_per_s=round((cycles - warmup) / elapsed), total_s=round(time.monotonic() - t0, 2),
                   client_fds_before=my_fds_before, client_fds_after=fd_count(os.getpid()))
    status = c.status()
    figures.update(hits=status["counters"].get("hits"), loads=status["counters"].get("loads"))
    record_figures("soak", figures)
    assert status["counters"].get("loads") == 1 and status["counters"].get("hits") == cycles, status["counters"]
    assert figures["fds_after"] == figures["fds_before"], figures
    assert (figures["rss_after_kib"] - figures["rss_before_kib"]) < 10 * 1024, figures
    assert figures["client_fds_after"] == figures["client_fds_before"], "attach/close leaks fds in the client"
    assert d.segment_files() == [s["name"] for s in status["segments"]]


# ----- 7. the daemon dies while clients wait for a load ------------------------------------
@pytest.mark.timeout(150)
def test_daemon_killed_while_client_waits(reaper: Reaper, big_h5: Path) -> None:
    n_clients, timeout = 3, 1.0
    work = reaper.tmpdir("h5s-wait-")
    d = reaper.start(reaper.daemon())
    c = reaper.client(d)
    go = work / "go"
    polling = [work / f"polling-{i}" for i in range(n_clients)]
    procs = [reaper.python(WAITING_CLIENT, json.dumps({
        "path": str(big_h5), "fallback": "lazy", "timeout": timeout, "runtime_dir": str(d.runtime_dir),
        "go": str(go), "rows": PROBE_ROWS, "polling": str(polling[i])})) for i in range(n_clients)]
    for p in procs:
        read_json_line(p, 90)  # imported
    go.touch()
    seg = wait_loading(c, big_h5, 30)
    assert wait_for(lambda: all(f.exists() for f in polling), 30), [f.name for f in polling if not f.exists()]
    assert next(s for s in segments_of(c, big_h5))["state"] == "loading"
    c.close()
    tree = descendant_pids(d.pid)
    t_kill = time.time()
    os.kill(d.pid, signal.SIGKILL)

    want = zlib.crc32(patterned_rows(PROBE_ROWS, BIG_ROW_SHAPE, BIG_CHUNK_ROWS).tobytes())
    delays = []
    for p in procs:
        out = read_json_line(p, 30)
        assert out["outcome"] == "dataset" and out["backend"] == "lazy", out
        assert out["warnings"] and "lazily" in out["warnings"][0]
        delays.append(out["t"] - t_kill)
        assert out["len"] == BIG_ROWS and out["rows_crc"] == want, "lazy fallback read wrong rows"
        assert p.wait(timeout=20) == 0
    assert max(delays) < timeout + 1.5, f"clients fell back {delays} s after the kill (timeout {timeout})"

    # later, a restarted daemon serves new clients. First the dead daemon's processes must be gone:
    # a surviving loader would race the restart's recovery.
    assert wait_for(lambda: not any(alive(p) for p in tree), 15), [p for p in tree if alive(p)]
    assert wait_for(lambda: not os.path.exists(f"/proc/{d.pid}"), 15), "the killed daemon was never reaped"
    reaper.start(d)
    assert not any(temporary_owner_pid(n) is not None for n in d.segment_files())
    ds = reaper.keep(SharedH5Dataset(big_h5, "x", "y", rank=0, world_size=1, runtime_dir=d.runtime_dir,
                                     fallback="error", timeout=10.0))
    assert ds.backend == "shm"
    batch = ds.__getitems__(PROBE_ROWS)
    assert zlib.crc32(batch.x.numpy().tobytes()) == want and batch.y.tolist() == PROBE_ROWS
    c2 = reaper.client(d, timeout=10.0)
    whole = patterned_crc(BIG_ROWS, BIG_ROW_SHAPE, BIG_CHUNK_ROWS)
    for mode in ("contiguous", "interleave"):  # interleave over one rank: the same rows, a fresh load
        t0 = time.monotonic()
        result = c2.acquire(Acquire(str(big_h5), "x", 1, 0, mode))
        load_wall = time.monotonic() - t0
        seg2 = attach_segment(result.shm_dir, result.name)
        try:
            assert zlib.crc32(seg2.data) == whole, f"{mode}: the shard's bytes are wrong"
        finally:
            seg2.close()
    (fresh,) = [s for s in d.status()["segments"] if s["key"] == "x" and s["mode"] == "interleave"]
    record_figures("kill9_while_waiting", {
        "clients": n_clients, "timeout_s": timeout, "fallback_after_kill_s": [round(x, 3) for x in delays],
        "rows_done_at_kill": seg["rows_done"], "big_shard_mib": round(fresh["bytes"] / 2**20),
        "big_load_s": fresh["load_s"], "big_acquire_wall_s": round(load_wall, 2)})


# ----- found while writing 5: error replies lose the request id ----------------------------
@dataclass(frozen=True)
class _FutureOp:
    """A request this daemon does not know (what a newer client might send)."""

    OP: ClassVar[str] = "frobnicate"


@pytest.mark.timeout(60)
def test_protocol_error_reply_carries_the_request_id(reaper: Reaper) -> None:
    d = reaper.start(reaper.daemon())
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"ipc://{d.runtime_dir}/h5serve.sock")
        sent = [_pack({"v": 1, "id": 4242, "op": "frobnicate"}),
                _pack({"v": 1, "id": 4243, "op": "acquire", "path": "/x.h5", "key": "x", "world_size": 1,
                       "rank": 0, "mode": "contiguous", "dtype": None, "priority": 1})]
        ids = []
        for frame in sent:
            sock.send(frame)
            assert sock.poll(5000, zmq.POLLIN)
            reply = msgpack.unpackb(sock.recv(), raw=False)
            assert reply["ok"] is False and reply["code"] == "protocol"
            ids.append(reply["id"])
        sock.close()
    finally:
        ctx.destroy(linger=0)
    assert ids == [4242, 4243], f"error replies carry ids {ids}"
    c = reaper.client(d, timeout=0.5)
    t = time.monotonic()
    with pytest.raises(ProtocolError):
        c.request(_FutureOp())  # type: ignore[arg-type]
    assert time.monotonic() - t < 0.5
