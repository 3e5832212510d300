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
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from ..errors import SourceChanged, code_for
from ..segments import SegmentMeta, create_segment
from ..sharding import Selection
from ..source import inspect_dataset, open_h5, read_shard_into, sources_unchanged

__all__ = ["LoadJob", "start_load", "loader_context"]

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class LoadJob:
    shm_dir: Path
    tmp_name: str
    final_name: str
    meta: SegmentMeta
    group: int | None = None


def loader_context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["h5serve.source", "h5serve.segments"])
    return ctx


def _die_with_parent() -> None:
    # A loader whose daemon was SIGKILLed must not keep writing: ask the kernel to kill it.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _run(job: LoadJob, reply: Connection) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when loads stop
    writer = None
    try:
        meta = job.meta
        writer = create_segment(job.shm_dir, job.tmp_name, meta, job.group)
        with open_h5(meta.source_path) as f:
            info = inspect_dataset(f, meta.key)
            selection = Selection(meta.mode, meta.world_size, meta.rank)
            read_shard_into(f[meta.key], info, selection, writer.data, writer.set_progress)
        if not sources_unchanged(meta.source, meta.linked):
            raise SourceChanged(f"{meta.source_path} changed while it was being loaded; request it again")
        writer.publish(job.final_name)
        writer = None
        reply.send(("ok", "", ""))
    except BaseException as exc:  # report everything: the daemon turns it into an error reply
        if writer is not None:
            writer.abort()
        reply.send(("error", code_for(exc), f"{exc}" if code_for(exc) != "remote" else f"{type(exc).__name__}: {exc}"))
    finally:
        reply.close()


def start_load(ctx: multiprocessing.context.BaseContext, job: LoadJob) -> tuple[multiprocessing.Process, Connection]:
    """Start a loader process for ``job``; the returned pipe end receives (status, code, message)."""
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_run, args=(job, sender), name=f"h5serve-load-{job.meta.key}-r{job.meta.rank}", daemon=True)
    process.start()
    sender.close()
    return process, receiver
