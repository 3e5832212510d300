"""Test helpers: real HDF5 files, a real daemon started through the CLI, process helpers that
always kill what they started."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from h5serve.demo.daemon import DaemonProcess

ROWS = 1000
ROW_SHAPE = (3, 4, 4)


def h5serve_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run the real ``h5serve`` command line (as users do) with a deadline."""
    return subprocess.run(
        [sys.executable, "-m", "h5serve", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def short_tmpdir(prefix: str) -> Path:
    # ipc socket paths are limited to 107 characters: pytest's tmp_path can be longer
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


@contextlib.contextmanager
def short_workdir(prefix: str) -> Iterator[Path]:
    """A short_tmpdir, removed with everything in it on exit."""
    where = short_tmpdir(prefix)
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def start_with_files(d: DaemonProcess, soft: int, hard: int) -> DaemonProcess:
    """``h5serve start`` (with ``d``'s flags) under an open-file limit of ``soft``/``hard``."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    done = subprocess.run([sys.executable, "-m", "h5serve", "start", *d.extra], env=d.env, capture_output=True,
                          text=True, timeout=60, preexec_fn=limit, check=False)
    assert done.returncode == 0, done.stderr
    d.pid = int((d.runtime_dir / "h5serve.pid").read_text())
    return d


class Daemon(DaemonProcess):
    """A real daemon on its own runtime dir, started with ``h5serve start``; ``stop`` also
    removes the runtime dir."""

    def __init__(self, *extra: str) -> None:
        super().__init__(short_tmpdir("h5s-rt-"), extra)

    def stop(self, timeout: float = 40) -> None:
        try:
            super().stop(timeout)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def temporary_prefix(d: DaemonProcess) -> str:
    """How every temporary of ``d``'s loads is named, up to the loader's pid: the temporary
    tells nobody which segment it becomes (segments/naming.py), so tests find a load's by this."""
    from h5serve.segments import temporary_name
    from h5serve.wire.runtime import resolve_runtime

    namespace = resolve_runtime(d.runtime_dir).namespace
    return temporary_name(namespace).rsplit("-", 2)[0] + "-"


@contextlib.contextmanager
def running_daemon(*args: str) -> Iterator[Daemon]:
    """A real daemon (``h5serve start ARGS`` on a runtime dir of its own), stopped on the way out."""
    d = Daemon(*args)
    try:
        yield d.start()
    finally:
        d.stop()


def make_h5(path: Path, rows: int = ROWS, row_shape: tuple[int, ...] = ROW_SHAPE, dtype: str = "uint8",
            chunks: bool = True) -> Path:
    """x[i] is filled with values derived from i; y[i] == i (labels are row ids)."""
    x = (np.arange(rows * int(np.prod(row_shape)), dtype=np.int64).reshape(rows, *row_shape) % 251).astype(dtype)
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=x, chunks=(min(64, max(rows, 1)), *row_shape) if chunks and rows else None)
        f.create_dataset("y", data=np.arange(rows, dtype=np.int64))
        f.create_dataset("group/nested/x", data=x)
    return path


def write_small_h5(path: Path) -> Path:
    """x: 4,096 rows of 16 float32 in chunks of 256 rows, y: their row numbers."""
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.arange(4096 * 16, dtype=np.float32).reshape(4096, 16), chunks=(256, 16))
        f.create_dataset("y", data=np.arange(4096))
    return path


def truncated(tmp_path: Path) -> tuple[Path, int, int]:
    """A file cut to half its bytes (a copy stopped early), the bytes it holds and should hold."""
    whole = write_small_h5(tmp_path / "whole.h5").read_bytes()
    cut = tmp_path / "cut.h5"
    cut.write_bytes(whole[: len(whole) // 2])
    return cut, len(whole) // 2, len(whole)


def damaged_header(tmp_path: Path) -> Path:
    """A file whose dataset x's object header is overwritten with garbage."""
    path = write_small_h5(tmp_path / "damaged.h5")
    with h5py.File(path, "r") as f:
        address = h5py.h5o.get_info(f["x"].id).addr  # where x's object header starts
    with open(path, "r+b") as raw:
        raw.seek(address)
        raw.write(b"\xde\xad\xbe\xef" * 8)
    return path


def descendant_pids(pid: int) -> list[int]:
    """``pid``'s children, theirs, ... (from /proc, parents found in each process's stat)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_daemon_of(runtime_dir: Path) -> None:
    """SIGKILL whatever daemon ``runtime_dir``'s pidfile names (test cleanup, as root; the
    tests' own daemons only)."""
    try:
        pid = int((runtime_dir / "h5serve.pid").read_text().strip() or 0)
    except (OSError, ValueError):
        return
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_for(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def alive(pid: int) -> bool:
    """Exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def writable_shared_dirty_kib(pid: int | str = "self") -> int:
    """KiB of ``pid``'s private writable mappings still shared copy-on-write with another
    process (relro sections, read-only once linked, also count in smaps' Shared_Dirty: not
    these)."""
    total, writable = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            name, *rest = line.split()
            if not name.endswith(":"):
                writable = rest[0] == "rw-p"
            elif name == "Shared_Dirty:" and writable:
                total += int(rest[0])
    return total


@contextlib.contextmanager
def tmpfs(size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's syntax: ``1m``) mounted on a fresh short dir, unmounted and
    removed on exit; the test is skipped where it cannot be mounted (needs root)."""
    import pytest

    where = short_tmpdir("h5s-tmpfs-")
    try:
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, timeout=30).returncode != 0:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        try:
            yield where
        finally:
            subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)
    finally:
        shutil.rmtree(where, ignore_errors=True)


def expected_checksum(data: bytes | np.ndarray) -> str:
    """The checksum a load records for rows ``data``, computed with the hashing library itself
    (not h5serve's code): crc32c where the crc32c package hashes in hardware, else zlib's crc32."""
    import zlib

    from h5serve.util.crc import LOAD_CRC

    if LOAD_CRC.name == "crc32c":
        import crc32c

        return f"crc32c:{crc32c.crc32c(bytes(data)):08x}"
    return f"crc32:{zlib.crc32(bytes(data)):08x}"


WORLD_4 = 4  # the field tests' layouts: 4 ranks, in node mode 2 nodes of 2


def open_ds(path: Any, where: dict[str, Any], **kwargs: Any) -> Any:
    """A SharedH5Dataset of ``path`` on ``where`` (a daemon's runtime dir with fallback="error",
    or nowhere with fallback="lazy"), asserting it got the backend that implies."""
    import warnings

    from h5serve.client import SharedH5Dataset

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "reading lazily": expected for lazy
        ds = SharedH5Dataset(path, **where, **kwargs)
    assert ds.backend == ("shm" if where["fallback"] == "error" else "lazy")
    return ds


def rank_args(mode: str, rank: int) -> dict[str, Any]:
    """Rank ``rank`` of WORLD_4 in ``mode`` (node mode: 2 nodes of 2 ranks)."""
    if mode == "node":
        return {"mode": mode, "local_rank": rank % 2, "local_world_size": 2, "node_rank": rank // 2, "num_nodes": 2}
    return {"mode": mode, "rank": rank, "world_size": WORLD_4}


NAMESPACE = "abcd1234"  # segment tests: a namespace and secret of their own
SECRET = bytes(range(32))


def make_meta(rows: int = 6, row_shape: tuple[int, ...] = (3, 4), dtype: str = "float32", **changes: Any) -> Any:
    """A SegmentMeta of rank 1 of 2 of a made-up file, with ``changes`` applied."""
    from h5serve.segments import SegmentMeta

    values = dict(
        source_path="/data/train.h5",
        source_dev=64769,
        source_ino=123456,
        source_size=987654,
        source_mtime_ns=1_700_000_000_123_456_789,
        key="x",
        mode="contiguous",
        world_size=2,
        rank=1,
        total_rows=rows * 2,
        rows=rows,
        row_shape=tuple(row_shape),
        dtype=dtype,
        source_dtype="uint8",
    )
    values.update(changes)
    return SegmentMeta(**values)


def sample_data(meta: Any) -> np.ndarray:
    """Distinct values for every element of ``meta``'s rows."""
    n = meta.rows * int(np.prod(meta.row_shape, dtype=np.int64))
    return (np.arange(n) * 3 + 1).astype(meta.np_dtype).reshape((meta.rows, *meta.row_shape))


def torchrun_two_ranks(job: Path, args: list[str], out: Path, runtime_dir: Path, deadline: float) -> list[dict]:
    """``job`` under torchrun with 2 gloo ranks, each writing ``out/rank{r}.json``; killed (with
    everything it started) at ``deadline`` seconds. Returns both ranks' reports."""
    out.mkdir()
    env = {**os.environ, "H5SERVE_RUNTIME_DIR": str(runtime_dir), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(job.parents[2])}  # the repo: job scripts are in tests/jobs/
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(job), *args]
    process = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    output = output_or_kill(process, deadline, "a rank waited in a collective (unequal batches?)")
    assert process.returncode == 0, output[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def output_or_kill(process: subprocess.Popen[str], deadline: float, why: str = "") -> str:
    """``process``'s output (started with ``start_new_session=True``, stdout piped); past
    ``deadline`` seconds it, its process group and every descendant (torchrun starts each rank in a
    session of its own) are killed, and the output says so."""
    try:
        output, _ = process.communicate(timeout=deadline)
    except subprocess.TimeoutExpired:
        output = f"killed after {deadline} s" + (f": {why}" if why else "")
    finally:
        if process.poll() is None:
            started = descendant_pids(process.pid)
            os.killpg(process.pid, signal.SIGKILL)
            for pid in started:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            process.wait()
    return output


def vlen_file(path: Path, mib: dict[str, float], first_rows: int = 1024, rows: int = 1100,
              first_length: int = 0) -> Path:
    """A file of variable-length float32 keys of ``rows`` rows whose first ``first_rows`` (all
    the daemon's estimate of a key's mean row length reads: hdf5/vlen.ESTIMATE_ROWS) hold
    ``first_length`` values each and whose last rows hold about ``mib[key]`` MiB of values
    (row ``i``'s values are ``i``); world-readable."""
    with h5py.File(path, "w") as f:
        for key, size in mib.items():
            v = f.create_dataset(key, (rows,), dtype=h5py.vlen_dtype(np.float32))
            long = int(size * (1 << 20)) // 4 // (rows - first_rows)
            for i in range(rows):
                v[i] = np.full(first_length if i < first_rows else long, i, dtype=np.float32)
    path.chmod(0o644)
    return path


class MemoryPeaks:
    """The most the daemon's budget counted (``used``: ``ping``'s, as ``status``'s memory used) and the most its
    files in its shm dir took in tmpfs (``allocated``: st_blocks * 512 of every file under its
    prefix, temporaries included), each sampled every few milliseconds."""

    def __init__(self) -> None:
        self.used = 0
        self.allocated = 0
        self.samples = 0


def daemon_files_allocated(d: DaemonProcess, shm_dir: Path = Path("/dev/shm")) -> int:
    """What ``d``'s files in ``shm_dir`` (segments and temporaries) take in tmpfs now."""
    from h5serve.segments import segment_prefix
    from h5serve.wire.runtime import resolve_runtime

    prefix = segment_prefix(resolve_runtime(d.runtime_dir).namespace)
    total = 0
    with os.scandir(shm_dir) as entries:
        for entry in entries:
            if entry.name.startswith(prefix):
                try:
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
                except FileNotFoundError:  # evicted, or a temporary published or removed, meanwhile
                    pass
    return total


@contextlib.contextmanager
def watch_memory(d: DaemonProcess, shm_dir: Path = Path("/dev/shm"), every: float = 0.01) -> Iterator[MemoryPeaks]:
    """Sample ``d``'s budget and what its files take in tmpfs (MemoryPeaks) in a thread for the
    duration of the block, and once more at its end."""
    import threading

    from h5serve.wire.connection import DaemonClient

    peaks, done = MemoryPeaks(), threading.Event()

    def sample(client: DaemonClient) -> None:
        peaks.allocated = max(peaks.allocated, daemon_files_allocated(d, shm_dir))
        peaks.used = max(peaks.used, int(client.ping()["used"]))  # status's segment list would load the daemon
        peaks.samples += 1

    def loop() -> None:
        with DaemonClient(d.runtime_dir, timeout=30) as client:
            while not done.wait(every):
                sample(client)
            sample(client)

    thread = threading.Thread(target=loop, name="watch-memory", daemon=True)
    thread.start()
    try:
        yield peaks
    finally:
        done.set()
        thread.join(60)


def segments_holding(shm_prefix: str, marker: bytes) -> list[str]:
    """Names of the segment files (published or temporary) under ``shm_prefix`` whose bytes hold ``marker``."""
    found = []
    for name in os.listdir("/dev/shm"):
        if name.startswith(shm_prefix):
            try:
                if marker in Path("/dev/shm", name).read_bytes():
                    found.append(name)
            except OSError:  # removed meanwhile (a failed load's temporary)
                pass
    return found


def holding(pids: list[int], marker: str) -> list[int]:
    """The processes among ``pids`` with a file whose path contains ``marker`` open."""
    out = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if marker in os.readlink(f"/proc/{pid}/fd/{fd}"):
                    out.append(pid)
                    break
            except OSError:
                pass
    return out
