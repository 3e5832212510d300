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

from .._process import KEPT_NAME, LOADER_NAME, set_process_name
from .arenaload import run_arena_load
from .loader import LoadJob, run_load
from .openfile import OpenFile

__all__ = ["serve_jobs"]


def serve_jobs(job: LoadJob, jobs: Connection, reply: Connection, daemon_gone: Callable[[], bool]) -> None:
    """Run ``job``, then every job that comes on ``jobs``, until one fails, the daemon closes
    ``jobs`` (it let this loader go, or is gone) or a job is not to be kept."""
    files = OpenFile()
    try:
        while (run_arena_load(job, reply, daemon_gone, files) if job.arena is not None
               else run_load(job, reply, daemon_gone, files)) and job.keep:
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
