"""The per-batch gather: single-threaded, off torch's thread pool, never changing torch's
thread settings, exact for every dtype and cast (NumPy's rules), fresh memory per batch, and
fork-safe afterwards. Real datasets, a real daemon, real forks; every test has a deadline and
kills what it starts. Speed is measured elsewhere (docs/performance.md), never here."""

from __future__ import annotations

import itertools
import mmap
import subprocess
import sys
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from h5serve.client.gather import RowSource, as_positions

from ..helpers import Daemon

pytestmark = pytest.mark.timeout(240)

DTYPES = ["bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32",
          "float64", "complex64"]


def values(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Values over the dtype's range (floats with nan, infinities and -0.0), so that every cast
    meets overflow, negative-to-unsigned and nan-to-integer cases."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, shape).astype(dt)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, shape, endpoint=True,
                            dtype=np.int64 if dt.kind == "i" else np.uint64).astype(dt)
    real = rng.standard_normal(shape) * 1000
    real.reshape(-1)[:4] = [np.nan, np.inf, -np.inf, -0.0]
    return (real + 1j * rng.standard_normal(shape)).astype(dt) if dt.kind == "c" else real.astype(dt)


def readonly_copy(data: np.ndarray) -> tuple[mmap.mmap, np.ndarray]:
    """``data`` in a read-only anonymous mapping, as a segment is mapped: writing it faults."""
    buf = mmap.mmap(-1, max(data.nbytes, 1))
    buf[: data.nbytes] = data.tobytes()
    ro = np.frombuffer(buf, dtype=data.dtype, count=data.size).reshape(data.shape)
    ro.flags.writeable = False
    return buf, ro


@pytest.mark.parametrize("source,requested", list(itertools.product(DTYPES, DTYPES)))
def test_every_cast_equals_numpy(source: str, requested: str) -> None:
    """Every source/requested pair: the rows NumPy's take + astype give, in the torch dtype
    torch.from_numpy gives them, in fresh writable memory; the read-only source is untouched."""
    if np.dtype(source).kind == "c" and np.dtype(requested).kind != "c":
        pytest.skip("complex to real drops the imaginary part with a ComplexWarning: not a cast h5serve serves")
    data = values(source, (300, 2, 3))
    buf, ro = readonly_copy(data)
    source_rows = RowSource(ro, np.dtype(requested))
    positions = torch.from_numpy(np.random.default_rng(1).permutation(300)[:257])
    with warnings.catch_warnings(), np.errstate(invalid="ignore", over="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # nan/inf to integer: NumPy warns, as astype does
        want = data[positions.numpy()].astype(requested)
        got = source_rows.take(positions)
    assert got.dtype == torch.from_numpy(want).dtype and tuple(got.shape) == want.shape
    assert np.array_equal(got.numpy(), want, equal_nan=want.dtype.kind in "fc")
    assert got.numpy().flags.writeable and not np.shares_memory(got.numpy(), ro)
    got.zero_()  # fresh memory: writing a batch changes nothing served
    assert np.array_equal(ro, data, equal_nan=data.dtype.kind in "fc")
    del source_rows, ro
    buf.close()


def test_gather_layouts_and_empty() -> None:
    """A strided (non-contiguous) source, a 1-d source, an empty batch and repeated positions."""
    data = np.arange(600, dtype=np.int32).reshape(200, 3)
    strided = data[::2]
    pos = as_positions([5, 5, -1, 0], len(strided))
    assert np.array_equal(RowSource(strided, np.dtype("int64")).take(pos).numpy(), strided[[5, 5, 99, 0]])
    labels = np.arange(50, dtype=np.int64)
    assert RowSource(labels, labels.dtype).take(as_positions([49, 0], 50)).tolist() == [49, 0]
    empty = RowSource(data, np.dtype("float32")).take(as_positions([], 200))
    assert tuple(empty.shape) == (0, 3) and empty.dtype == torch.float32


def test_as_positions_kinds() -> None:
    """Every kind of index the dataset accepts, with the same IndexErrors as before."""
    n = 10
    assert as_positions(torch.tensor([1, -1, 9]), n).tolist() == [1, 9, 9]
    assert as_positions(torch.tensor([[1, 2], [3, -2]], dtype=torch.int32), n).tolist() == [1, 2, 3, 8]
    assert as_positions(np.array([-10, 0], dtype=np.int16), n).tolist() == [0, 0]
    assert as_positions(np.array([3, 4], dtype=np.uint64), n).tolist() == [3, 4]
    assert as_positions((7, 2), n).tolist() == [7, 2]
    strided = torch.arange(20)[::2]  # a strided view: a compact copy
    got = as_positions(strided, 20)
    assert got.tolist() == list(range(0, 20, 2)) and got.untyped_storage().nbytes() == 80
    fast = torch.tensor([0, 3, 9])
    assert as_positions(fast, n) is fast  # the samplers' int64 batches pass as they are
    for bad in ([10], [-11], torch.tensor([0, 10]), torch.tensor([-11]), np.array([2**62])):
        with pytest.raises(IndexError):
            as_positions(bad, n)
    for bad in (torch.tensor([1.0]), torch.tensor([True]), [0.5], np.array([1.5])):
        with pytest.raises(IndexError, match="integers"):
            as_positions(bad, n)


def _write(path: Path, rows: int, row_shape: tuple[int, ...] = (3, 8, 8)) -> Path:
    x = (np.arange(rows * int(np.prod(row_shape)), dtype=np.int64) % 251).astype(np.uint8).reshape(rows, *row_shape)
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=x, chunks=(256, *row_shape))
        f.create_dataset("y", data=np.arange(rows, dtype=np.int64))
    return path


def _run(script: str, timeout: float = 180) -> str:
    """``script`` in a fresh interpreter (nothing earlier in this test process has touched its
    thread pool), killed at the deadline."""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


_THREADS = """
import os, threading, warnings, torch
warnings.simplefilter("ignore")
from h5serve.client import SharedH5Dataset, make_loader, collate
torch.set_num_threads(2)
def threads():
    return set(os.listdir("/proc/self/task"))
for rt in ({runtime_dir!r}, "/nonexistent-h5s-rt"):
    ds = SharedH5Dataset({path!r}, "x", "y", runtime_dir=rt, timeout=0.5, dtype_x="float32")
    for t in threading.enumerate():  # the acquire's inotify descriptor is closed by a short-lived thread
        if t.name == "h5serve-unwatch":
            t.join(10)
    before = threads()
    big = torch.arange(0, len(ds), 2)  # ~20k rows of 192 bytes: torch.index_select ran this on its pool
    for _ in range(3):
        x, y = collate(ds.__getitems__(big))
        assert torch.equal(y, big) and x.dtype == torch.float32
    started = len(threads() - before)  # a thread of ours ending meanwhile is no thread started
    for batch in make_loader(ds, 4096, shuffle=False):
        pass
    print(ds.backend, started, torch.get_num_threads())
    ds.close()
"""


def test_gathers_never_touch_torch_threads(tmp_path: Path, shared_daemon: Daemon) -> None:
    """A gather starts no thread (torch's pool stays unstarted: index_select on 20k rows used
    to start it) and iterating a dataset leaves torch.get_num_threads() as the user set it,
    on the shm and the lazy backend."""
    path = _write(tmp_path / "rows.h5", 40_000)
    out = _run(_THREADS.format(runtime_dir=str(shared_daemon.runtime_dir), path=str(path)))
    lines = [line.split() for line in out.split("\n") if line]
    assert [line[0] for line in lines] == ["shm", "lazy"], out
    for _, started, threads in lines:
        assert started == "0", out
        assert threads == "2", out


_FORK = """
import os, signal, time, warnings, torch
warnings.simplefilter("ignore")
from h5serve.client import SharedH5Dataset, make_loader, collate
def threads():
    return len(os.listdir("/proc/self/task"))
user_threads = torch.get_num_threads()
for rt in ({runtime_dir!r}, "/nonexistent-h5s-rt"):
    ds = SharedH5Dataset({path!r}, "x", "y", runtime_dir=rt, timeout=0.5)
    start = threads()
    for epoch in range(2):
        for batch in make_loader(ds, 512, seed=epoch):
            pass
    pool = threads() > start  # the samplers' randperm over 40k rows runs on torch's pool
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(20)
        big = torch.randn(1500, 1500)
        (big @ big + 1).sum()
        x, y = collate(ds.__getitems__(torch.arange(0, 40000, 3)))
        assert y[5] == 15
        os._exit(0)
    for _ in range(30 * 20):  # 30 s
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise SystemExit("the forked child hung")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, ("child died", ds.backend, status)
    print(ds.backend, pool, torch.get_num_threads() == user_threads)
    ds.close()
"""


def test_fork_after_gathering_does_not_hang(tmp_path: Path, shared_daemon: Daemon) -> None:
    """After a few epochs through make_loader over 40k rows (the sampler's randperm starts
    torch's OpenMP pool; GNU OpenMP is not fork-safe), a plain fork() child can run parallel
    torch ops and gather, within a deadline, on both backends; the parent keeps its threads."""
    path = _write(tmp_path / "rows.h5", 40_000)
    out = _run(_FORK.format(runtime_dir=str(shared_daemon.runtime_dir), path=str(path)))
    lines = [line.split() for line in out.split("\n") if line]
    assert [line[0] for line in lines] == ["shm", "lazy"], out
    assert all(line[2] == "True" for line in lines), out
