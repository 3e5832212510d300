"""One load split across several loader processes (``h5serve start --load-processes N``).

Real daemons started with ``h5serve start``, real /dev/shm, real processes. The split
threshold is lowered through $H5SERVE_MIN_PART_BYTES (a testing knob read by the loader), so
small gzip+shuffle files are split into three parts; the kill test uses a large file and the
default threshold. Every test has a deadline and kills what it started.
"""

from __future__ import annotations

import os
import re
import signal
import zlib
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5serve.client import SharedH5Dataset
from h5serve.errors import DataError
from h5serve.segments import temporary_owner_pid
from h5serve.wire.connection import DaemonClient
from h5serve.wire.protocol import Acquire

from ..helpers import (
    Daemon,
    alive,
    expected_checksum,
    h5serve_cli,
    holding,
    short_workdir,
    temporary_prefix,
    wait_for,
)

ROWS, ROW_SHAPE, CHUNK_ROWS = 3000, (3, 8, 8), 50
PARTS = 3


# ----- processes --------------------------------------------------------------------------
def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state first), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def descendants(pid: int) -> dict[int, int]:
    """Live descendants of ``pid``: {pid: parent pid}."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None and fields[0] != "Z":
                parents[int(entry)] = int(fields[1])
    out, todo = {}, [pid]
    while todo:
        parent = todo.pop()
        for child, ppid in parents.items():
            if ppid == parent:
                out[child] = ppid
                todo.append(child)
    return out


def _is_spare(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() == "h5serve-spare"
    except OSError:
        return False


def loaders_of(daemon_pid: int) -> list[int]:
    """Loader processes and their part children: every descendant of the daemon below its
    direct children (the forkserver, and the resource tracker if any), but the spare loader
    waiting for the next load (daemon/loading/spare.py)."""
    return [p for p, parent in descendants(daemon_pid).items() if parent != daemon_pid and not _is_spare(p)]


def kill_tree(d: Daemon) -> None:
    """Stop the daemon (gracefully if it is alive), SIGKILL what is left of its process group
    (forkserver, loaders) and remove the segment files a killed daemon leaves in /dev/shm."""
    names = d.segment_files() if d.runtime_dir.exists() else []
    try:
        d.stop()
    finally:
        if d.pid:
            try:
                os.killpg(d.pid, signal.SIGKILL)  # the daemon leads its own session and group
            except (ProcessLookupError, PermissionError):
                pass
        for name in names:
            try:
                os.unlink(f"/dev/shm/{name}")
            except FileNotFoundError:
                pass


def start_daemon(*args: str, min_part_bytes: int | None = None) -> Daemon:
    d = Daemon(*args)
    if min_part_bytes is not None:
        d.env["H5SERVE_MIN_PART_BYTES"] = str(min_part_bytes)
    try:
        return d.start()
    except BaseException:
        kill_tree(d)
        raise


# ----- data -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with short_workdir("h5s-pl-") as where:
        yield where


@pytest.fixture(scope="module")
def gzip_file(workdir: Path) -> Path:
    """x: uint8 images, f: the same values as float64; both gzip+shuffle, 60 chunks."""
    x = np.random.default_rng(7).integers(0, 16, size=(ROWS, *ROW_SHAPE), dtype=np.uint8)
    path = workdir / "gzip.h5"
    with h5py.File(path, "w") as f:
        for key, data in (("x", x), ("f", x.astype(np.float64) / 3)):
            f.create_dataset(key, data=data, chunks=(CHUNK_ROWS, *ROW_SHAPE), compression="gzip", shuffle=True)
    return path


@pytest.fixture(scope="module")
def parallel_daemon() -> Iterator[Daemon]:
    d = start_daemon("--load-processes", str(PARTS), min_part_bytes=64)
    try:
        yield d
    finally:
        kill_tree(d)


def h5_rows(path: Path, key: str, indices: np.ndarray) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f[key][...][indices]


# ----- 0. how a load is cut ---------------------------------------------------------------
def test_plan_parts() -> None:
    from h5serve.daemon.loading.loader import MIN_PART_BYTES, plan_parts
    from h5serve.hdf5.source import DatasetInfo
    from h5serve.order.sharding import Selection

    def info(rows: int) -> DatasetInfo:  # 1 MiB rows, 10 rows per chunk
        return DatasetInfo(key="x", rows=rows, row_shape=(1024, 1024), dtype=np.dtype("uint8"), chunk_rows=10)

    whole = Selection("contiguous", 1, 0)
    assert MIN_PART_BYTES == 32 * 2**20
    assert plan_parts(info(63), whole, 8) == [(0, 63)]  # under two minimum parts: one process
    assert plan_parts(info(100), whole, 1) == [(0, 100)]
    assert plan_parts(info(100), whole, 2) == [(0, 50), (50, 100)]
    assert plan_parts(info(100), whole, 8) == [(0, 30), (30, 70), (70, 100)]  # at most 100 MiB / 32 MiB parts
    parts = plan_parts(info(1000), Selection("interleave", 3, 1), 4)  # rows 1, 4, ..., 997
    assert len(parts) == 4 and parts[0][0] == 1 and parts[-1][1] == 998
    assert all(a < b == c for (a, b), (c, _) in zip(parts, parts[1:])) and all(b % 10 == 0 for _, b in parts[:-1])


# ----- 1. the same bytes, from three processes --------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["contiguous", "interleave"])
@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("key,dtype", [("x", None), ("f", "float32")])
def test_split_load_is_byte_identical(parallel_daemon: Daemon, gzip_file: Path, mode: str, world_size: int,
                                      key: str, dtype: str | None) -> None:
    crcs: dict[int, int] = {}
    for rank in range(world_size):
        ds = SharedH5Dataset(gzip_file, key, mode=mode, rank=rank, world_size=world_size, dtype_x=dtype,
                             runtime_dir=parallel_daemon.runtime_dir, fallback="error", timeout=30)
        try:
            assert ds.backend == "shm"
            want = h5_rows(gzip_file, key, ds.indices)
            if dtype is not None:
                want = want.astype(dtype)
            got = ds.__getitems__(list(range(len(ds)))).x.numpy()
            assert got.dtype == want.dtype and got.shape == want.shape
            assert got.tobytes() == want.tobytes()
            crcs[rank] = expected_checksum(got.tobytes())
        finally:
            ds.close()
    segments = [s for s in parallel_daemon.status()["segments"]
                if s["key"] == key and s["mode"] == mode and s["world_size"] == world_size]
    assert len(segments) == world_size
    for s in segments:
        assert s["state"] == "ready" and s["load_parts"] == PARTS, s  # really read by three processes
        assert s["dtype"] == (dtype or "uint8")  # float64 asked as float32 is stored as float32
        # each part hashed its own rows while writing them; joined, the crc of all the rows
        assert s["checksum"] == crcs[s["rank"]], s


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["contiguous", "interleave"])
def test_split_raw_copy_checksum(parallel_daemon: Daemon, workdir: Path, mode: str) -> None:
    """Uncompressed rows are copied file to file (no pass through Python): the parts' crcs,
    taken while they copy, still join into the checksum of exactly the rows served."""
    path = workdir / "plain.h5"
    if not path.exists():
        with h5py.File(path, "w") as f:
            f["x"] = np.random.default_rng(3).integers(0, 255, size=(ROWS, *ROW_SHAPE), dtype=np.uint8)
    ds = SharedH5Dataset(path, "x", mode=mode, rank=1, world_size=2, runtime_dir=parallel_daemon.runtime_dir,
                         fallback="error", timeout=30)
    try:
        got = ds.__getitems__(list(range(len(ds)))).x.numpy()
        assert got.tobytes() == h5_rows(path, "x", ds.indices).tobytes()
    finally:
        ds.close()
    [seg] = [s for s in parallel_daemon.status()["segments"] if s["file"] == str(path) and s["mode"] == mode]
    assert seg["load_parts"] == PARTS and seg["checksum"] == expected_checksum(got.tobytes()), seg
    assert h5serve_cli("status", "--verify", env=parallel_daemon.env).returncode == 0


# ----- 2. a damaged chunk in the middle part ----------------------------------------------
def _damaged_file(path: Path) -> Path:
    """60 rows in 12 gzip+shuffle chunks of 5; the chunk of rows 25..29 is not a deflate stream.
    Split in three, the damage is in the middle part (rows 20..39)."""
    with h5py.File(path, "w") as f:
        dset = f.create_dataset("x", (60, 4), "f4", chunks=(5, 4), compression="gzip", shuffle=True)
        dset[...] = np.arange(240, dtype=np.float32).reshape(60, 4)
        dset.id.write_direct_chunk((25, 0), b"this is not a deflate stream" * 3)
    return path


def _load_error(d: Daemon, path: Path) -> str:
    with pytest.raises(DataError, match=r"cannot read rows \d+\.\.\d+ of dataset 'x'.*damaged") as caught:
        SharedH5Dataset(path, "x", rank=0, world_size=1, runtime_dir=d.runtime_dir, fallback="error", timeout=30)
    return str(caught.value)


@pytest.mark.timeout(120)
def test_damaged_chunk_in_middle_part(parallel_daemon: Daemon, workdir: Path) -> None:
    path = _damaged_file(workdir / "damaged.h5")
    parallel = _load_error(parallel_daemon, path)
    single_daemon = start_daemon("--load-processes", "1")
    try:
        single = _load_error(single_daemon, path)
    finally:
        kill_tree(single_daemon)
    # the same reason; the rows named are those of the failing read (one part's block, not the shard's)
    assert re.sub(r"rows \d+\.\.\d+", "rows A..B", parallel) == re.sub(r"rows \d+\.\.\d+", "rows A..B", single)
    lo, hi = map(int, re.search(r"rows (\d+)\.\.(\d+)", parallel).groups())
    assert 20 <= lo <= 25 and 29 <= hi <= 39, parallel
    # no temporary left behind, no loader or part process survives the failure
    assert not [n for n in parallel_daemon.segment_files() if temporary_owner_pid(n) is not None]
    assert wait_for(lambda: not loaders_of(parallel_daemon.pid), 10), descendants(parallel_daemon.pid)
    # and the daemon still serves
    status = parallel_daemon.status()
    assert status["running"] is True and status["counters"]["load_errors"] >= 1


# ----- 3. kill -9 of the daemon while three processes load --------------------------------
BIG_ROW_SHAPE = (64, 64, 3)  # 12 KiB rows
BIG_CHUNK_ROWS = 256
BIG_ROWS = 51200  # 600 MiB of uint8


def _big_file(path: Path) -> Path:
    """600 MiB of gzip+shuffle uint8 rows, written fast: eight compressed chunk variants written
    with write_direct_chunk (shuffle is the identity for 1-byte elements)."""
    base = np.arange(BIG_CHUNK_ROWS * int(np.prod(BIG_ROW_SHAPE)), dtype=np.int64) // 7
    variants = [zlib.compress(((base + 13 * v) % 251 + np.random.default_rng(v).integers(0, 2, base.shape))
                              .astype(np.uint8).tobytes(), 6) for v in range(8)]
    with h5py.File(path, "w") as f:
        d = f.create_dataset("x", shape=(BIG_ROWS, *BIG_ROW_SHAPE), dtype="uint8",
                             chunks=(BIG_CHUNK_ROWS, *BIG_ROW_SHAPE), compression="gzip", shuffle=True)
        for i in range(BIG_ROWS // BIG_CHUNK_ROWS):
            d.id.write_direct_chunk((i * BIG_CHUNK_ROWS, 0, 0, 0), variants[i % 8])
    return path


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["kill -9", "h5serve stop"])
def test_daemon_gone_mid_split_load_leaves_no_loader(workdir: Path, how: str) -> None:
    """SIGKILL of the daemon alone (the loader notices through its pidfd, kills its part
    children; PR_SET_PDEATHSIG covers the rest), or a graceful stop (the daemon SIGKILLs the
    loader; its children die with it): every loader process is gone within seconds, nothing is
    published."""
    big = workdir / "big.h5"
    if not big.exists():
        _big_file(big)
    d = start_daemon("--load-processes", str(PARTS))
    client = DaemonClient(d.runtime_dir, timeout=5.0)
    try:
        client.request(Acquire(str(big), "x", 1, 0))  # starts the load; nobody waits for it
        seg: dict = {}

        def loading() -> bool:
            nonlocal seg
            seg = next((s for s in client.status()["segments"] if s["key"] == "x"), {})
            assert seg.get("state") != "ready", "the load finished before the daemon went: make the file bigger"
            return seg.get("state") == "loading" and seg["rows_done"] > 0

        assert wait_for(loading, 30, interval=0.01), seg
        tree = loaders_of(d.pid)
        writers = holding(tree, temporary_prefix(d))
        assert len(writers) == PARTS, (tree, writers)  # the loader and its two part children
        client.close()
        if how == "kill -9":
            os.kill(d.pid, signal.SIGKILL)
        else:
            done = h5serve_cli("stop", env=d.env, timeout=40)
            assert done.returncode == 0, done.stderr
        assert wait_for(lambda: not any(alive(p) for p in tree), 5), [p for p in tree if alive(p)]
        left = d.segment_files()
        assert seg["name"] not in left, "the interrupted load was published"
        if how == "kill -9":  # only the temporary, for the next start to remove
            assert all(n.startswith(temporary_prefix(d)) for n in left), left
        else:
            assert left == [], left
    finally:
        client.close()
        kill_tree(d)


# ----- 4. refused options -----------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_bad_load_processes_is_refused(value: str) -> None:
    d = Daemon()
    try:
        done = h5serve_cli("start", "--load-processes", value, env=d.env)
        assert done.returncode == 2, done
        assert "--load-processes" in done.stderr
        assert ("at least 1" if value != "two" else "whole number") in done.stderr
        assert not (d.runtime_dir / "h5serve.sock").exists()
    finally:
        d.stop()
