"""Reserving a segment's memory while the loader gets ready to fill it.

A load reserves every byte of its segment (``posix_fallocate``: a full tmpfs is a ShmFull
error, never a SIGBUS) before it writes any. That takes 25-80 ms for 300 MB on the bench's VM,
and a loader used to do nothing else meanwhile; now a thread reserves while the loader (and
its part processes, forked first) open the file, inspect the dataset and find its chunks,
and every process waits for the reservation before its first write (``Reservation.wait``,
``Parts.wait_reserved``). A small segment (a stream block of a few chunks) is reserved in the
loader's own thread instead: starting a thread costs more than its ``fallocate``, and a window of
many small blocks is a load each.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ...segments import SegmentWriter

__all__ = ["INLINE_RESERVE_BYTES", "Reservation"]

INLINE_RESERVE_BYTES = 4 << 20  # a segment up to this size is reserved without a thread of its own


class Reservation:
    """``writer.reserve_all()`` in a thread (``inline``: here, before returning); ``done()`` is
    called once it succeeded."""

    def __init__(self, writer: SegmentWriter, done: Callable[[], None], inline: bool = False) -> None:
        self.seconds = 0.0  # how long reserving took
        self.done_ns = time.monotonic_ns()  # when it was done (``time.monotonic_ns``)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if inline:
            self._run(writer, done)
            return
        self._thread = threading.Thread(target=self._run, args=(writer, done), name="h5serve-reserve", daemon=True)
        # A thread that has started still needs the GIL to reach posix_fallocate, and this
        # one's Python work (opening the file, finding its chunks) kept it for a switch
        # interval (5 ms) first: returning once the thread is on its way into the call
        # (which lets the GIL go) starts the reservation at once.
        self._entering = threading.Event()
        self._thread.start()
        self._entering.wait()

    def _run(self, writer: SegmentWriter, done: Callable[[], None]) -> None:
        started = time.monotonic_ns()
        try:
            if self._thread is not None:
                self._entering.set()
            writer.reserve_all()
            done()
        except BaseException as exc:  # noqa: BLE001 - raised by wait(), in the loader's own thread
            self._error = exc
        self.done_ns = time.monotonic_ns()
        self.seconds = (self.done_ns - started) / 1e9

    def wait(self) -> None:
        """Return once every byte is reserved.

        Raised when the shm filesystem has no room: ShmFull (from SegmentWriter.reserve_all).
        """
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error

    def settle(self) -> None:
        """Wait for the thread whatever happened (before the segment's descriptor is closed)."""
        if self._thread is not None:
            self._thread.join()
