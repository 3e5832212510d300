"""A real daemon on a runtime dir of its own, driven through the ``h5serve`` command line as
users drive it: the demo, the benchmarks and the tests start and stop theirs with this.

Internal: not part of the documented surface (h5serve/__init__.py). It lives with the demo, its
first user, below the command line it drives as a subprocess (so h5serve.cli, which runs the
demo, and this never import each other); the daemon runs in its own process, so nothing here
imports ``h5serve.daemon``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import H5ServeError
from ..segments import segment_prefix
from ..wire.runtime import resolve_runtime, resolve_shm_dir

__all__ = ["DaemonProcess"]

_KILLED_WAIT_S = 2.0  # how long a SIGKILLed daemon gets to be gone before its segments are removed


class DaemonProcess:
    """``h5serve start`` with ``flags`` on ``workdir/rt``; ``stop`` stops it, or kills it and
    removes what it left in shm when it does not stop. ``workdir`` is the caller's to remove."""

    def __init__(self, workdir: Path, flags: Sequence[str] = (), env: Mapping[str, str] | None = None) -> None:
        self.dir = Path(workdir)
        self.runtime_dir = self.dir / "rt"
        self.env = {**(os.environ if env is None else env), "H5SERVE_RUNTIME_DIR": str(self.runtime_dir)}
        self.extra = tuple(flags)
        self.pid = 0
        self.start_output = ""

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run the real ``h5serve`` command line against this daemon, with a deadline."""
        return subprocess.run([sys.executable, "-m", "h5serve", *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout)

    def start(self) -> DaemonProcess:
        """Raised when ``h5serve start`` fails: H5ServeError with what it printed."""
        done = self.cli("start", *self.extra, timeout=120)
        if done.returncode != 0:
            raise H5ServeError(f"could not start the daemon: {done.stderr.strip()}")
        self.start_output = done.stdout
        self.pid = int((self.runtime_dir / "h5serve.pid").read_text())
        return self

    def status(self) -> dict[str, Any]:
        return dict(json.loads(self.cli("status", "--json").stdout))

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

    def segment_files(self) -> list[str]:
        """This daemon's segment files in /dev/shm."""
        prefix = segment_prefix(resolve_runtime(self.runtime_dir).namespace)
        return sorted(p for p in os.listdir("/dev/shm") if p.startswith(prefix))

    def stop(self, timeout: float = 40) -> None:
        """``h5serve stop``; if the daemon is still there after it, SIGKILL and remove its segments.
        A daemon already gone (a test's ``kill -9``) cleaned nothing up: its segments are removed
        too (an ``h5serve stop`` leaves what the daemon chose to keep)."""
        if not self.alive():
            if self.pid:
                self._remove_segments()
            return
        try:
            self.cli("stop", timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        if not self.alive():
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + _KILLED_WAIT_S  # its loaders watch it and stop; then nothing writes
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._remove_segments()

    def _remove_segments(self) -> None:
        shm = resolve_shm_dir()
        prefix = segment_prefix(resolve_runtime(self.runtime_dir).namespace)
        try:
            for name in os.listdir(shm):
                if name.startswith(prefix):
                    (shm / name).unlink(missing_ok=True)
        except OSError:
            pass
