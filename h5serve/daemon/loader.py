"""HDF5 -> shared memory, in loader processes.

h5py serialises every call behind one global lock and does not release the GIL reliably,
so loads run in separate processes (forkserver: a clean parent with numpy and h5py already
imported, no ZeroMQ threads). A loader writes into a temporary segment, reports progress in
its header, and renames it into place only when every row is there. The daemon reaps the
result over a pipe.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import select
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable

from ..errors import SourceChanged, code_for
from ..segments import SegmentMeta, create_segment
from ..sharding import Selection
from ..reads import read_shard_into
from ..source import inspect_dataset, open_h5, sources_unchanged

__all__ = ["LoadJob", "start_load", "loader_context"]

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class LoadJob:
    shm_dir: Path
    tmp_name: str
    final_name: str
    meta: SegmentMeta
    group: int | None = None
    daemon_pid: int = 0


class DaemonGone(Exception):
    """Raised inside a loader when the daemon that asked for the load has exited."""


def loader_context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["h5serve.source", "h5serve.segments"])
    return ctx


def _die_with_daemon(daemon_pid: int) -> Callable[[], bool]:
    """Make sure a loader never outlives its daemon, so a SIGKILLed daemon never gets a
    segment published behind its back. Returns a cheap "is the daemon gone?" check.

    The loader's parent is the forkserver, not the daemon, and the forkserver only exits once
    every holder of its "alive" pipe is gone, loaders included: so the loader drops its copy
    of that pipe, asks for SIGKILL when the forkserver dies, and also watches the daemon
    itself through a pidfd (readable once the daemon exits, even while it is a zombie).
    """
    from multiprocessing import forkserver

    alive_fd = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_alive_fd", None)
    if isinstance(alive_fd, int):
        try:
            os.close(alive_fd)
        except OSError:
            pass
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    try:
        pidfd = os.pidfd_open(daemon_pid) if daemon_pid else -1
    except (OSError, AttributeError):  # no pidfd (old kernel): PDEATHSIG still applies
        pidfd = -1
    if pidfd < 0:
        return lambda: False
    return lambda: bool(select.select([pidfd], [], [], 0)[0])


def _run(job: LoadJob, reply: Connection) -> None:
    daemon_gone = _die_with_daemon(job.daemon_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when loads stop
    writer = None
    try:
        meta = job.meta
        writer = create_segment(job.shm_dir, job.tmp_name, meta, job.group)

        def progress(rows_done: int) -> None:
            if daemon_gone():
                raise DaemonGone()
            writer.set_progress(rows_done)

        with open_h5(meta.source_path) as f:
            info = inspect_dataset(f, meta.key)
            selection = Selection(meta.mode, meta.world_size, meta.rank)
            read_shard_into(f[meta.key], info, selection, writer.data, progress)
        if not sources_unchanged(meta.source, meta.linked):
            raise SourceChanged(f"{meta.source_path} changed while it was being loaded; request it again")
        if daemon_gone():
            raise DaemonGone()
        writer.publish(job.final_name)
        writer = None
        reply.send(("ok", "", ""))
    except BaseException as exc:  # report everything: the daemon turns it into an error reply
        if writer is not None:
            writer.abort()
        if not isinstance(exc, DaemonGone):
            message = f"{exc}" if code_for(exc) != "remote" else f"{type(exc).__name__}: {exc}"
            try:
                reply.send(("error", code_for(exc), message))
            except OSError:
                pass
    finally:
        reply.close()


def start_load(ctx: multiprocessing.context.BaseContext, job: LoadJob) -> tuple[multiprocessing.Process, Connection]:
    """Start a loader process for ``job``; the returned pipe end receives (status, code, message)."""
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_run, args=(job, sender), name=f"h5serve-load-{job.meta.key}-r{job.meta.rank}", daemon=True)
    process.start()
    sender.close()
    return process, receiver
