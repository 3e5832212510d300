"""A stream block's rows loaded into a slot of its key's arena (segments/arena.py), in a
loader process: the same part reader as a segment's load
(``loader._read_part`` through ``ArenaSlotWriter``, which offers what it takes of a
``SegmentWriter``: ``data`` and ``data_target``), one part, no checksum, no page cache drop.

The arena is opened by name relative to the shm dir, ``O_NOFOLLOW``, and used only if its
inode is the one the daemon created (``ArenaTarget.ino``): nobody swaps in another file.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from ...errors import SegmentError, SourceChanged
from ...hdf5.identity import identities_unchanged
from ...segments import SegmentMeta
from ...segments.arena import ArenaTarget
from ...segments.lifecycle import reserve_range
from ...util.units import PAGE_BYTES
from .loader import LoadError, LoadJob, LoadOk, LoadStats, read_part
from .openfile import OpenFile
from .parts import DaemonGone, error_of

__all__ = ["ArenaSlotWriter", "open_slot", "run_arena_load"]


class ArenaSlotWriter:
    """One slot of an arena, writable: ``data`` (the block's rows) and ``data_target`` as a
    segment writer offers them to the part reader."""

    def __init__(self, fd: int, target: ArenaTarget, meta: SegmentMeta) -> None:
        assert target.offset % PAGE_BYTES == 0
        self._fd, self.target, self.meta = fd, target, meta
        self._map = mmap.mmap(fd, max(target.nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
                              offset=target.offset)
        self.data = np.ndarray((meta.rows, *meta.row_shape), dtype=meta.np_dtype, buffer=self._map)

    def data_target(self) -> tuple[int, int]:
        return self._fd, self.target.offset

    def set_progress(self, rows_done: int) -> None:
        pass  # the daemon sees a slot's load by its reply only

    def mark_activity(self) -> None:
        pass

    def close(self) -> None:
        del self.data
        try:
            self._map.close()
        except BufferError:  # a view still alive: the mapping goes with it
            pass
        os.close(self._fd)


def open_slot(shm_dir: Path, target: ArenaTarget, meta: SegmentMeta) -> ArenaSlotWriter:
    """``target``'s slot, opened, checked and its pages reserved (a slot is sparse until loaded).

    Raised when the arena is not the file the daemon created (gone, replaced): SegmentError.
    Raised when the shm filesystem has no room for the slot: ShmFull, as a segment's load."""
    dir_fd = os.open(shm_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        fd = os.open(target.name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        raise SegmentError(f"stream arena {target.name} cannot be opened: {exc.strerror}") from exc
    finally:
        os.close(dir_fd)
    st = os.fstat(fd)
    if st.st_ino != target.ino or st.st_uid != os.geteuid() or st.st_size < target.offset + target.nbytes:
        os.close(fd)
        raise SegmentError(f"stream arena {target.name} is not the file the daemon created")
    try:
        reserve_range(fd, target.offset, target.nbytes, meta, shm_dir)
    except BaseException:
        os.close(fd)
        raise
    return ArenaSlotWriter(fd, target, meta)


def run_arena_load(job: LoadJob, reply: Connection, daemon_gone: Callable[[], bool], files: OpenFile) -> bool:
    """Run ``job`` (``job.arena`` set) in this kept loader, through the file it keeps open;
    report LoadOk or LoadError on ``reply``. Returns whether the load succeeded."""
    assert job.arena is not None
    writer: ArenaSlotWriter | None = None
    try:
        t0 = time.monotonic()
        meta = job.meta
        writer = open_slot(job.shm_dir, job.arena, meta)
        source = files.open(meta)

        def progress(rows_done: int) -> None:
            if daemon_gone():
                raise DaemonGone()

        first = read_part(meta, meta.row_range, writer, None, progress, False, lambda: None,  # type: ignore[arg-type]
                          source, False, files.places, virtual_ok=job.virtual_ok)
        if not identities_unchanged(meta.identities()):
            raise SourceChanged(f"{meta.source_path} changed while it was being loaded; request it again")
        read_s = time.monotonic() - t0
        writer.close()
        writer = None
        reply.send(LoadOk(LoadStats(1, 0.0, first.copied, read_s, (read_s,), "", 0.0, 0, 0), job.arena.name))
        return True
    except BaseException as exc:  # reported: the daemon frees the slot
        if writer is not None:
            writer.close()
        files.close()
        if not isinstance(exc, DaemonGone):
            code, message = error_of(exc)
            try:
                reply.send(LoadError(code, message))
            except OSError:
                pass
        return False
