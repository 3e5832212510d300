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

import h5py
import numpy as np

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


class Daemon:
    """A real daemon on its own runtime dir, started with ``h5serve start``."""

    def __init__(self, *extra: str) -> None:
        self.dir = short_tmpdir("h5s-rt-")
        self.runtime_dir = self.dir / "rt"
        self.env = {**os.environ, "H5SERVE_RUNTIME_DIR": str(self.runtime_dir)}
        self.extra = extra
        self.pid = 0

    def start(self) -> Daemon:
        done = h5serve_cli("start", *self.extra, env=self.env)
        assert done.returncode == 0, done.stderr
        self.pid = int((self.runtime_dir / "h5serve.pid").read_text())
        return self

    def status(self) -> dict:
        done = h5serve_cli("status", "--json", env=self.env)
        return json.loads(done.stdout)

    def alive(self) -> bool:
        if not self.pid:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        # a zombie is not alive: the CLI that started it has exited, init reaps it
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().split(") ", 1)[1][0] != "Z"
        except OSError:
            return False

    def stop(self) -> None:
        try:
            if self.alive():
                h5serve_cli("stop", env=self.env, timeout=40)
        finally:
            if self.alive():
                os.kill(self.pid, signal.SIGKILL)
            shutil.rmtree(self.dir, ignore_errors=True)

    def segment_files(self) -> list[str]:
        from h5serve.runtime import resolve_runtime
        from h5serve.segments import segment_prefix

        prefix = segment_prefix(resolve_runtime(self.runtime_dir).namespace)
        return sorted(p for p in os.listdir("/dev/shm") if p.startswith(prefix))


def make_h5(path: Path, rows: int = ROWS, row_shape: tuple[int, ...] = ROW_SHAPE, dtype: str = "uint8",
            chunks: bool = True) -> Path:
    """x[i] is filled with values derived from i; y[i] == i (labels are row ids)."""
    x = (np.arange(rows * int(np.prod(row_shape)), dtype=np.int64).reshape(rows, *row_shape) % 251).astype(dtype)
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=x, chunks=(min(64, max(rows, 1)), *row_shape) if chunks and rows else None)
        f.create_dataset("y", data=np.arange(rows, dtype=np.int64))
        f.create_dataset("group/nested/x", data=x)
    return path


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


def expected_checksum(data: bytes | np.ndarray) -> str:
    """The checksum a load records for rows ``data``, computed with the hashing library itself
    (not h5serve's code): crc32c where the crc32c package hashes in hardware, else zlib's crc32."""
    import zlib

    from h5serve.crc import LOAD_CRC

    if LOAD_CRC.name == "crc32c":
        import crc32c

        return f"crc32c:{crc32c.crc32c(bytes(data)):08x}"
    return f"crc32:{zlib.crc32(bytes(data)):08x}"
