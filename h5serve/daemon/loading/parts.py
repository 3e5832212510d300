"""The multi-process part of one load (``--load-processes``): the children reading parts
1..N-1 of a shard into the same segment, as the loader (daemon/loading/loader.py) sees them.

The loader forks one child per part but the first while no HDF5 file is open (h5py handles
must never cross a fork). A forked child inherits the segment's descriptor and ``pwrite``s
its rows through it (explicit offsets: the shared file position does not matter); it reports
rows done in a shared anonymous mapping of counters and an error as a pickled
``(code, message)`` over its own pipe, and leaves with ``os._exit`` (never running Python
cleanup of what it inherited: the writer, the reply pipe).
"""

from __future__ import annotations

import mmap
import os
import pickle
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import SegmentError, code_for
from .._process import set_pdeathsig
from .loadresult import LoadError

__all__ = ["Parts", "PartResult", "PartFailed", "DaemonGone", "error_of", "report_failure", "EXIT_DAEMON_GONE"]

_REAP_S = 5.0  # how long killed children get to be reaped before the loader stops waiting
EXIT_DAEMON_GONE = 3  # a child's exit status when it stopped because the daemon is gone
_RESERVED_POLL_S = 0.0005  # how often a part process looks whether the segment is reserved


class DaemonGone(Exception):
    """Raised inside a loader when the daemon that asked for the load has exited."""


class PartFailed(Exception):
    """Raised in the loader when a child reading one part reported an error (or died)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def error_of(exc: BaseException) -> tuple[str, str]:
    """(code, message) as the daemon reports it for ``exc``."""
    if isinstance(exc, PartFailed):
        return exc.code, exc.message
    code = code_for(exc)
    return code, (f"{exc}" if code != "remote" else f"{type(exc).__name__}: {exc}")


def report_failure(reply: Any, exc: BaseException) -> None:
    """Tell the daemon on ``reply`` that a load failed with ``exc`` (its LoadError), unless the
    daemon is gone (DaemonGone: nobody to tell) or the pipe is closed."""
    if isinstance(exc, DaemonGone):
        return
    code, message = error_of(exc)
    try:
        reply.send(LoadError(code, message))
    except OSError:
        pass


@dataclass(frozen=True)
class PartResult:
    """What one part of a load did: bytes copied file to file, and the crc32 of its rows
    (-1 when not asked for)."""

    copied: int
    crc: int


class Parts:
    """The children reading parts 1..N-1 of one load, as the loader sees them.

    ``counters[i]`` is the rows part ``i`` has written (part 0: the loader's own),
    ``finished[i]`` when it was done (``time.monotonic_ns``), ``copied[i]`` the bytes it
    copied file to file and ``crcs[i]`` the crc32 of its rows (-1: not computed), and whether
    the segment is reserved yet, in a shared anonymous mapping created before the forks.
    """

    def __init__(self, count: int) -> None:
        self._shared = mmap.mmap(-1, 32 * count + 8)
        self.counters = np.frombuffer(self._shared, dtype=np.int64, count=count)
        self.finished = np.frombuffer(self._shared, dtype=np.int64, count=count, offset=8 * count)
        self.copied = np.frombuffer(self._shared, dtype=np.int64, count=count, offset=16 * count)
        self.crcs = np.frombuffer(self._shared, dtype=np.int64, count=count, offset=24 * count)
        self._reserved = np.frombuffer(self._shared, dtype=np.int64, count=1, offset=32 * count)
        self.children: dict[int, tuple[int, int, tuple[int, int]]] = {}  # pid -> (part, read fd, span)
        self._payload: dict[int, bytearray] = {}

    def mark_reserved(self) -> None:
        """The segment is reserved: the parts may write (reserve.py)."""
        self._reserved[0] = 1

    def wait_reserved(self, daemon_gone: Callable[[], bool]) -> None:
        """In a part process: wait until the loader has reserved the segment (the loader kills
        its parts when that fails).

        Raised when the daemon is gone meanwhile: DaemonGone.
        """
        while not self._reserved[0]:
            if daemon_gone():
                raise DaemonGone()
            time.sleep(_RESERVED_POLL_S)

    def rows_done(self) -> int:
        return int(self.counters.sum())

    def fork(self, index: int, span: tuple[int, int], work: Callable[[Callable[[int], None]], PartResult],
             daemon_gone: Callable[[], bool], close_in_child: tuple[int, ...]) -> None:
        """Start the child for part ``index``: it runs ``work(progress)`` (which returns what
        its part did) and exits."""
        r, w = os.pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child: never returns, never runs Python cleanup of inherited objects
            status = 1
            try:
                set_pdeathsig()
                if os.getppid() != parent:  # the loader died before PDEATHSIG was armed
                    raise DaemonGone()
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                for fd in (r, *close_in_child, *(fd for _, fd, _ in self.children.values())):
                    os.close(fd)
                counters, finished, copied, crcs = self.counters, self.finished, self.copied, self.crcs

                def progress(rows_done: int) -> None:
                    counters[index] = rows_done
                    if daemon_gone():
                        raise DaemonGone()

                result = work(progress)
                copied[index], crcs[index] = result.copied, result.crc
                finished[index] = time.monotonic_ns()
                status = 0
            except DaemonGone:
                status = EXIT_DAEMON_GONE
            except BaseException as exc:  # noqa: BLE001 - reported to the loader, whatever it is
                try:
                    blob = memoryview(pickle.dumps(error_of(exc)))
                    while blob:
                        blob = blob[os.write(w, blob):]
                except BaseException:  # noqa: BLE001, S110 - the exit status still says it failed
                    pass
            finally:
                os._exit(status)
        os.close(w)
        os.set_blocking(r, False)
        self.children[pid] = (index, r, span)
        self._payload[pid] = bytearray()

    def _drain(self, pid: int) -> None:
        fd = self.children[pid][1]
        while True:
            try:
                data = os.read(fd, 65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if not data:
                return
            self._payload[pid] += data

    def check(self, timeout: float = 0.0) -> None:
        """Reap the children that finished, waiting up to ``timeout`` for one to.

        Raised when a part failed: PartFailed with its error (the first one seen); when a
        child stopped because the daemon is gone: DaemonGone.
        """
        if not self.children:
            return
        if timeout > 0:
            by_fd = {fd: pid for pid, (_, fd, _) in self.children.items()}
            try:  # a child's pipe turns readable when it reports an error or exits
                ready = select.select(list(by_fd), [], [], timeout)[0]
            except InterruptedError:
                ready = []
            for fd in ready:
                self._drain(by_fd[fd])
        for pid in list(self.children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 1 << 8
            if done == 0:
                continue
            self._drain(pid)  # it has exited: whatever it wrote is in the pipe
            index, fd, (a, b) = self.children.pop(pid)
            os.close(fd)
            payload = bytes(self._payload.pop(pid))
            if payload:
                try:
                    code, message = pickle.loads(payload)
                except Exception:  # noqa: BLE001 - a truncated report is still a failure
                    code, message = SegmentError.code, f"the loader process for rows {a}..{b - 1} failed"
                raise PartFailed(code, message)
            if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
                continue
            if os.WIFEXITED(status) and os.WEXITSTATUS(status) == EXIT_DAEMON_GONE:
                raise DaemonGone()
            how = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                   else f"exit code {os.WEXITSTATUS(status)}")
            raise PartFailed(SegmentError.code, f"the loader process for rows {a}..{b - 1} of part {index} died "
                             f"({how}); see the daemon log")

    def kill_all(self) -> None:
        """SIGKILL and reap every child still running (reaping bounded by _REAP_S)."""
        for pid in self.children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + _REAP_S
        while self.children:
            for pid in list(self.children):
                try:
                    done = os.waitpid(pid, os.WNOHANG)[0]
                except ChildProcessError:
                    done = pid
                if done:
                    os.close(self.children.pop(pid)[1])
                    self._payload.pop(pid, None)
            if not self.children or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        for _, fd, _ in self.children.values():  # not reaped in time: init reaps them after us
            os.close(fd)
        self.children.clear()
