"""A loader kept for successive stream blocks (loaderpool.py): it runs one block's load after
another as its jobs arrive on its job pipe, through the source file it keeps open between them.

Only one-part loads read through the kept file (a load split across processes closes it first:
no h5py handle crosses a fork). The file is the one ``loader.open_source`` opened and checked
(the daemon's resolved device and inode, fstat of HDF5's own descriptor); it is opened again
whenever a job names another identity (path, device, inode, size, mtime: a file changed in
place is a new identity for the daemon too), and every load still checks the file's identity
after reading its rows, as any load does. A failed load closes it and ends the loader.
"""

from __future__ import annotations

from collections.abc import Callable
from multiprocessing.connection import Connection

import h5py

from ..hdf5.identity import open_h5_verified
from ..segments import SegmentMeta
from ._process import KEPT_NAME, LOADER_NAME, set_process_name
from .loader import LoadJob, run_load

__all__ = ["OpenFiles", "serve_jobs"]


class OpenFiles:
    """The source file a kept loader holds open between its loads."""

    def __init__(self) -> None:
        self._file: h5py.File | None = None
        self._identity: tuple = ()

    def open(self, meta: SegmentMeta) -> h5py.File:
        """``meta``'s source, opened and checked as ``loader.open_source`` does, once per
        identity. Raised as it is."""
        if self._file is None or self._identity != meta.source:
            self.close()
            # without HDF5's shared flock (HDF5 >= 1.10 takes one on every file it opens): the
            # file kept open between blocks would make every writer of it fail ("unable to lock
            # file") until this loader exits, where a one-load loader held it for one load. The
            # rows read are checked against the file's identity after every load (a write
            # changes its mtime), as in any loader, so the lock guards nothing here.
            self._file = open_h5_verified((meta.source_path, meta.source_dev, meta.source_ino), locking=False)
            self._identity = meta.source
        return self._file

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except Exception:  # noqa: BLE001 - closing a read-only handle: nothing to save
                pass
        self._file, self._identity = None, ()


def serve_jobs(job: LoadJob, jobs: Connection, reply: Connection, daemon_gone: Callable[[], bool]) -> None:
    """Run ``job``, then every job that comes on ``jobs``, until one fails, the daemon closes
    ``jobs`` (it let this loader go, or is gone) or a job is not to be kept."""
    files = OpenFiles()
    try:
        while run_load(job, reply, daemon_gone, files) and job.keep:
            set_process_name(KEPT_NAME)
            try:
                job = jobs.recv()
            except (EOFError, OSError):
                return
            set_process_name(LOADER_NAME)
    finally:
        files.close()
        jobs.close()
        reply.close()
