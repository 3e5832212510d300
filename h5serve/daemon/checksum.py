"""The crc of a segment's rows (h5serve/crc.py's LOAD_CRC), hashed while they are being written.

A load used to copy every row and then read the whole segment again for its crc32: on a
2-core machine that second pass took as long as the copy itself (~0.15 s for 293 MiB). Now
each loader process hashes the rows of its own part in a thread that follows the copy, a
block behind it: the crc is ready a block after the last row is written, and the parts'
crcs are joined in row order with ``LOAD_CRC.combine``.

Rows are written in ascending local order within a part (reads.read_shard_into), and a part
reports ``progress(n)`` only once its first ``n`` rows are in place, so the thread never
hashes a byte before it is written. Both kinds release the GIL while they hash.
"""

from __future__ import annotations

import threading

import numpy as np

from ..crc import LOAD_CRC

__all__ = ["FollowingCrc"]

_BLOCK_BYTES = 8 * 1024 * 1024  # hashed at a time: large enough that the GIL is rarely taken


class FollowingCrc:
    """crc32 of ``data[start:stop]`` (a flat uint8 view of the rows), computed by a thread
    as ``advance(upto)`` says the bytes before ``upto`` are written."""

    def __init__(self, data: np.ndarray, start: int, stop: int) -> None:
        self._data = data
        self._hashed = self._ready = start
        self._stop = stop
        self._crc = 0
        self._closed = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="h5serve-crc", daemon=True)
        self._thread.start()

    def advance(self, upto: int) -> None:
        """Bytes before ``upto`` (absolute offsets in ``data``) are written."""
        with self._cond:
            if upto > self._ready:
                self._ready = min(upto, self._stop)
                if self._ready - self._hashed >= _BLOCK_BYTES or self._ready >= self._stop:
                    self._cond.notify()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while (not self._closed and self._ready < self._stop
                           and self._ready - self._hashed < _BLOCK_BYTES):
                        self._cond.wait()
                    if self._closed:
                        return
                    end = self._ready
                if end > self._hashed:
                    self._crc = LOAD_CRC.update(self._data[self._hashed:end], self._crc)
                    self._hashed = end
                if end >= self._stop:
                    return
        except BaseException as exc:  # noqa: BLE001 - re-raised by result()
            self._error = exc

    def result(self) -> int:
        """The crc32 once every byte is written and hashed (call after the copy finished)."""
        self.advance(self._stop)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._crc

    def close(self) -> None:
        """Stop hashing (a failed load) and drop the view of the rows."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
        self._data = None  # type: ignore[assignment]
