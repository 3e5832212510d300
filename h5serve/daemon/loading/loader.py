"""HDF5 -> shared memory, in loader processes.

h5py serialises every call behind one global lock and does not release the GIL reliably,
so loads run in separate processes (forkserver: a clean parent with numpy and h5py already
imported, no ZeroMQ threads). A loader writes into a temporary segment, reports progress in
its header, and renames it into place only when every row is there. The daemon reaps the
result over a pipe.

One load can itself be split across several processes (``--load-processes``): the loader
cuts the shard's rows at chunk boundaries into parts (``reads.split_span``), forks one child
per part but the first while no HDF5 file is open (h5py handles must never cross a fork, and
HDF5 would hand a child the parent's open file again: each process opens the file itself
after the forks), reads the first part itself, and waits for the children (parts.py). A forked child
inherits the segment's descriptor and ``pwrite``s its rows through it (explicit offsets: the
shared file position does not matter), so they land in the same segment; it reports rows
done in a shared anonymous mapping of counters and an error as a pickled ``(code, message)``
over its own pipe, and leaves with ``os._exit`` (never running Python cleanup of what it
inherited: the writer, the reply pipe). The loader
alone holds the temporary's ``flock`` (the children's inherited fds share its open file
description, so a child exiting releases nothing), aborts the temporary if any part fails
and publishes only when every part succeeded.

Page cache (``LoadJob.drop_page_cache``, on unless ``h5serve start --keep-page-cache``): reading
the rows leaves the source file's pages in the page cache, a second copy of the data next to
the segment. Once the segment is published and the daemon told, the loader drops those pages
with ``posix_fadvise(POSIX_FADV_DONTNEED)``, over exactly the bytes of the file that reading
the load's rows reads (``rawcopy.data_extents``: the rows of uncompressed data, the whole
stored chunks of filtered data) and through the descriptor it read them with, so never pages
of another file, nor of another dataset of the same file (a concurrent load of ``y`` next to
``x`` keeps its pages), nor HDF5's metadata. Pages of those bytes that other processes had
cached go too (the page cache is shared); pages mapped by a process stay. The store leaves
the pages in place when a load still waiting for a loader will read some of the same rows
(interleaved shards of more ranks than ``--loaders``: every rank's load reads every row), so
that the last of them drops them.
Stream blocks (mode "stream") keep their pages: the daemon evicts a block within the epoch
and loads it again the next, and only the page cache can keep a file larger than the
budget (but not than memory) from being read from disk every epoch.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import signal
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path

import h5py
import numpy as np

from ...errors import SourceChanged
from ...hdf5.compound import rows_dataset
from ...hdf5.files import plan_file_parts
from ...hdf5.identity import check_holder, identities_unchanged, open_h5_verified, pinned_rows
from ...hdf5.rawcopy import WRITE_BEHIND_MIN_BYTES, StoredRows, data_extents, drop_cached
from ...hdf5.reads import ShardWrite, local_range, read_shard_into, shard_span, split_span
from ...hdf5.remote import is_url
from ...hdf5.source import DatasetInfo, inspect_dataset
from ...order.sharding import RowRange, Selection
from ...segments import SegmentMeta, SegmentWriter, create_segment
from ...segments.arena import ArenaTarget
from ...util.crc import LOAD_CRC
from ...util.units import row_nbytes
from .._process import LOADER_NAME, drop_forkserver_alive_fd, quiet_blas, set_pdeathsig, set_process_name
from .fileset import read_files_part
from .loadcrc import RunningCrc
from .loadresult import LoadError, LoadOk, LoadStats
from .openfile import OpenFile
from .parts import DaemonGone, PartResult, Parts, report_failure
from .remoteload import run_remote_load
from .reserve import INLINE_RESERVE_BYTES, Reservation
from .vlenload import Room, load_vlen

__all__ = ["LoadJob", "LoadStats", "LoadOk", "LoadError", "start_load", "run_load", "die_with_daemon",
           "loader_context", "start_forkserver", "plan_parts", "load_spans", "MIN_PART_BYTES",
           "MIN_PART_ENV", "read_part"]

# A part is worth its own process only above this many bytes of source rows (forking, opening
# the file and faulting in a fresh mapping cost a few ms; small shards stay in one process).
MIN_PART_BYTES = 32 * 1024 * 1024
# Testing knob: a smaller threshold, so tests can split small datasets into several parts.
MIN_PART_ENV = "H5SERVE_MIN_PART_BYTES"
_WAIT_S = 0.05  # how often the loader checks its children and the daemon while it waits


@dataclass(frozen=True)
class LoadJob:
    shm_dir: Path
    tmp_name: str
    final_name: str
    meta: SegmentMeta
    group: int | None = None
    daemon_pid: int = 0
    load_processes: int = 1  # processes one load may be split across (the loader and its children)
    checksum: bool = True  # crc32 of the rows into the header, for `h5serve status --verify`
    drop_page_cache: bool = True  # drop the source file's cached pages of the rows read, once published
    # the parts, planned by the daemon from the metadata it holds (``load_spans``), so that the
    # loader need not open the file before it forks; None: the loader plans them itself
    spans: tuple[tuple[int, int], ...] | None = None
    keep: bool = False  # the loader stays for more jobs on its job pipe (streamloader.py)
    # a virtual dataset may be read (HDF5 opens its sources by name): only for loads the daemon's
    # own user or root asked for; anyone else's load refuses one found in the file as opened
    virtual_ok: bool = False
    # variable-length rows: the bytes the segment may take, its share of the budget (vlenload.py); None for
    # fixed rows, whose segment's size is known before the load (the store counted exactly that)
    room: Room | None = None
    arena: ArenaTarget | None = None  # a stream block into a slot of its arena (arenaload.py)


_REMOTE_PRELOAD: list[str] = []  # what s3:// loads import, preloaded too when the daemon is told to fetch URLs


def start_forkserver(remote: bool = False) -> None:
    """Start the loaders' forkserver now (it imports numpy and h5py: a second or more on a busy
    node), so that the first load does not stall the control loop while it starts. ``remote``
    (``--allow-url`` given): it imports fsspec and s3fs too, when installed, so that no loader
    or inspection of an s3:// object imports them itself (0.4-1.5 s each here)."""
    if remote and not _REMOTE_PRELOAD:
        import importlib.util

        if importlib.util.find_spec("s3fs") is not None:
            _REMOTE_PRELOAD.extend(["fsspec", "s3fs", "h5serve.hdf5.fetch"])
    from multiprocessing import forkserver

    from .._process import clean_preparation, no_hdf5_file_locking, safe_python_env

    quiet_blas(os.environ)  # the forkserver starts with this process's environment
    safe_python_env(os.environ)
    no_hdf5_file_locking(os.environ)
    loader_context()
    with clean_preparation():  # the sys.path it is handed (Python >= 3.12 uses it), never a main module
        forkserver.ensure_running()


def loader_context() -> multiprocessing.context.ForkServerContext:
    """The forkserver context loaders and spares start in (``_process.LoaderContext``: the
    daemon's main module never imported again, no implicit sys.path entry, stderr kept)."""
    from .._process import LoaderContext

    ctx = LoaderContext()
    # everything a loader runs, so each loader starts in ~2 ms instead of importing ~20 ms of modules
    ctx.set_forkserver_preload(
        ["h5serve.hdf5.source", "h5serve.segments", "h5serve.hdf5.reads", "h5serve.daemon.loading.loader",
         "h5serve.daemon.loading.spare", "h5serve.daemon.access.inspector", *_REMOTE_PRELOAD])
    return ctx


def die_with_daemon(daemon_pid: int) -> Callable[[], bool]:
    """Make sure a loader never outlives its daemon, so a SIGKILLed daemon never gets a
    segment published behind its back. Returns a cheap "is the daemon gone?" check.

    The loader's parent is the forkserver, not the daemon, and the forkserver only exits once
    every holder of its "alive" pipe is gone, loaders included: so the loader drops its copy
    of that pipe, asks for SIGKILL when the forkserver dies, and also watches the daemon
    itself through a pidfd (readable once the daemon exits, even while it is a zombie).
    """
    drop_forkserver_alive_fd()
    set_pdeathsig()
    try:
        pidfd = os.pidfd_open(daemon_pid) if daemon_pid else -1
    except (OSError, AttributeError):  # no pidfd (old kernel): PDEATHSIG still applies
        pidfd = -1
    if pidfd < 0:
        return lambda: False
    return lambda: bool(select.select([pidfd], [], [], 0)[0])


def min_part_bytes() -> int:
    """MIN_PART_BYTES, or $H5SERVE_MIN_PART_BYTES when set to a positive integer (tests)."""
    try:
        value = int(os.environ.get(MIN_PART_ENV, ""))
    except ValueError:
        return MIN_PART_BYTES
    return value if value > 0 else MIN_PART_BYTES


def plan_parts(info: DatasetInfo, selection: Selection | RowRange, processes: int,
               min_part: int | None = None) -> list[tuple[int, int]]:
    """The global row ranges one load is split into: at most ``processes``, each at least about
    ``min_part`` bytes of source rows, cut at chunk boundaries. One part: no split."""
    first, last = shard_span(info, selection)
    work = (last - first) * row_nbytes(info.row_shape, info.dtype)
    wanted = min(max(processes, 1), max(1, work // (min_part or min_part_bytes())))
    return split_span(first, last, info, wanted) if wanted > 1 else [(first, last)]


def open_source(meta: SegmentMeta) -> h5py.File:
    """The one-file source of ``meta``, opened by HDF5 and checked to be the very file the
    daemon resolved and checked (device and inode: identity.open_h5_verified), never what
    stands at its path now. Raised otherwise: SourceChanged (SourceNotFound when it is gone)."""
    return open_h5_verified((meta.source_path, meta.source_dev, meta.source_ino))


def holders(meta: SegmentMeta) -> tuple[tuple, ...]:
    """The identities the file holding a one-file load's rows may have: the external link's
    target the daemon checked (``meta.linked``), else the source itself."""
    return (meta.linked,) if meta.linked else (meta.source,)


def _read_part(meta: SegmentMeta, rows: RowRange, writer: SegmentWriter, span: tuple[int, int] | None,
               progress: Callable[[int], None], checksum: bool, ready: Callable[[], None],
               f: h5py.File | None = None, drop_page_cache: bool = False,
               places: dict[tuple[str, ...], StoredRows | None] | None = None, *,
               virtual_ok: bool) -> PartResult:
    """Read the shard's rows in global rows ``span`` (None: all of them) into the segment, with
    this process's own h5py handle (``f``, or the file opened here), hashing them on their way
    in when ``checksum`` (daemon/loading/loadcrc.py). Files are written with ``pwrite`` and ``splice``
    at explicit offsets, so every part can write through the one inherited descriptor. Many
    files as one dataset: each file of the span opened in turn (fileset.py), its cached pages
    dropped as it is done with ``drop_page_cache``. ``ready()`` returns once the segment is
    reserved: called before the first write. ``places``: a kept loader's memo of where rows are
    stored in ``f`` (openfiles.py), used only for a dataset in ``f`` itself. ``virtual_ok``: as
    ``LoadJob.virtual_ok``, checked on the dataset as opened here (identity.pinned_rows)."""
    crc = RunningCrc() if checksum else None
    hashed = None if crc is None else crc.update
    if meta.files:
        ready()
        copied = read_files_part(meta, rows, writer, span, progress, drop_page_cache, hashed, virtual_ok=virtual_ok)
        return PartResult(copied, -1 if crc is None else crc.value)
    if f is None:
        with open_source(meta) as f:
            return _read_part(meta, rows, writer, span, progress, checksum, ready, f, virtual_ok=virtual_ok)
    # HDF5 follows an external link by path: the file it opened must be the one checked
    dset = pinned_rows(f, meta.key, holders(meta), f"{meta.source_path}[{meta.key}]", virtual_ok=virtual_ok)
    info = inspect_dataset(f, meta.key)
    if places is not None and dset.file.id.get_vfd_handle() != f.id.get_vfd_handle():
        places = None  # an external link's file: HDF5 may close and reopen it between loads
    copied = read_shard_into(dset, info, rows, writer.data, progress, span,
                             ShardWrite(writer.data_target(), hashed, ready, places=places,
                                        write_behind=span is None and meta.nbytes > WRITE_BEHIND_MIN_BYTES))
    return PartResult(copied, -1 if crc is None else crc.value)


read_part = _read_part  # the arenas' loads (arenaload.py) read through it too


def _joined_crc(first: PartResult, spans: list[tuple[int, int] | None], parts: Parts | None,
               writer: SegmentWriter) -> int:
    """The crc32 of every row: the parts' crcs joined in row order."""
    if parts is None:
        return first.crc
    row = writer.data.nbytes // max(len(writer.data), 1)
    rows = writer.meta.row_range
    total = first.crc
    for index, span in enumerate(spans[1:], 1):
        assert span is not None
        k0, k1 = local_range(*span, rows.start, rows.step, len(writer.data))
        total = LOAD_CRC.combine(total, int(parts.crcs[index]), (k1 - k0) * row)
    return total


def _read_extents(f: h5py.File, meta: SegmentMeta, rows: RowRange) -> tuple[int, list[tuple[int, int]]]:
    """The descriptor of the file that holds ``meta.key``'s rows (an external link's target
    included) and the byte ranges of it that this load read; ``(-1, [])`` when not known."""
    try:
        dset = rows_dataset(f, meta.key)  # a compound field: the rows of its dataset were read
        check_holder(dset, holders(meta), meta.key)  # never the pages of a file swapped in since
        extents = data_extents(dset, *rows.span)
        return (dset.file.id.get_vfd_handle(), extents) if extents else (-1, [])
    except Exception:  # noqa: BLE001 - an optimisation: a dataset it cannot describe keeps its pages
        return -1, []


def _one_process(meta: SegmentMeta, processes: int) -> bool:
    """Whether a load is read by one process whatever its size."""
    return processes <= 1 or meta.rows == 0 or bool(meta.vlen)


def _too_small(meta: SegmentMeta) -> bool:
    """Whether a one-file shard spans too few source rows to be worth more than one process."""
    rows = meta.row_range
    return (rows.stop - rows.start) * row_nbytes(meta.row_shape, np.dtype(meta.source_dtype)) < 2 * min_part_bytes()


def load_spans(info: DatasetInfo, meta: SegmentMeta, processes: int) -> tuple[tuple[int, int], ...]:
    """The parts of a one-file load, planned from ``info`` (the daemon's metadata of the
    dataset, so that the loader opens nothing before it forks); one part when not worth it."""
    if _one_process(meta, processes) or meta.files or _too_small(meta):
        return (meta.row_range.span,)
    return tuple(plan_parts(info, meta.row_range, processes))


def _spans(job: LoadJob, rows: RowRange) -> list[tuple[int, int] | None]:
    """Parts for one load: ``[None]`` (one process reads the whole shard) unless it is worth
    splitting. Opens the file only when it may be and the daemon did not plan the parts (and
    closes it before anything forks)."""
    meta, processes = job.meta, job.load_processes
    if _one_process(meta, processes):
        return [None]
    if meta.files:  # split at file boundaries: each process opens its own files
        row = row_nbytes(meta.row_shape, np.dtype(meta.source_dtype))
        spans = plan_file_parts(rows, meta.file_rows, row, processes, min_part_bytes())
    elif _too_small(meta):
        return [None]
    elif job.spans is not None:
        spans = list(job.spans)
    else:
        with open_source(meta) as f:
            info = inspect_dataset(f, meta.key)
        spans = plan_parts(info, rows, processes)
    return [None] if len(spans) <= 1 else list(spans)


class _Progress:
    """Rows done, as the loader's header shows them: this process's own rows and, for a load
    split across processes, what every part reported, never backwards. Called by the read
    between blocks: stops the load (DaemonGone) once the daemon is gone."""

    def __init__(self, writer: SegmentWriter, parts: Parts | None, daemon_gone: Callable[[], bool]) -> None:
        self.writer, self.parts, self.daemon_gone = writer, parts, daemon_gone
        self.shown = 0

    def __call__(self, rows_done: int) -> None:
        if self.daemon_gone():
            raise DaemonGone()
        total = rows_done
        if self.parts is not None:
            self.parts.counters[0] = rows_done
            self.parts.check()
            total = self.parts.rows_done()
        if total > self.shown:  # monotonic, whatever order the parts report in
            self.writer.set_progress(total)
            self.shown = total


def _fork_parts(job: LoadJob, spans: list[tuple[int, int] | None], writer: SegmentWriter, parts: Parts,
                daemon_gone: Callable[[], bool], reply: Connection) -> None:
    """One child process per part but the first, each reading its span into ``writer`` once the
    reservation is done. Before this process opens the file for reading (no h5py handle
    crosses a fork); the reservation thread is in posix_fallocate, holding no lock a child could need."""
    meta, rows = job.meta, job.meta.row_range
    for index, span in enumerate(spans[1:], 1):
        assert span is not None  # more than one part: each has its span

        def work(progress: Callable[[int], None], span: tuple[int, int] = span) -> PartResult:
            return _read_part(meta, rows, writer, span, progress, job.checksum,
                              lambda: parts.wait_reserved(daemon_gone), drop_page_cache=job.drop_page_cache,
                              virtual_ok=job.virtual_ok)

        parts.fork(index, span, work, daemon_gone, (reply.fileno(),))


def _wait_for_parts(parts: Parts | None, progress: _Progress, daemon_gone: Callable[[], bool]) -> None:
    """Until every child part is done (reaped), showing their progress; DaemonGone once the daemon is."""
    while parts is not None and parts.children:
        if daemon_gone():
            raise DaemonGone()
        parts.check(_WAIT_S)
        progress(int(parts.counters[0]))


def _abort(exc: BaseException, parts: Parts | None, reservation: Reservation | None, writer: SegmentWriter | None,
           files: OpenFile | None, reply: Connection) -> None:
    """A load that failed: its parts killed before the temporary goes (nothing writes into it any
    more), the reservation settled, the temporary removed; the error reported (not when the
    daemon is gone: nobody reads it)."""
    if parts is not None:
        parts.kill_all()
    if reservation is not None:
        reservation.settle()  # nothing uses the descriptor any more when it is closed
    if writer is not None:
        writer.abort()
    if files is not None:
        files.close()
    report_failure(reply, exc)


def run_load(job: LoadJob, reply: Connection, daemon_gone: Callable[[], bool] | None = None,
             files: OpenFile | None = None) -> bool:
    """Run ``job`` in this (loader) process and report on ``reply``; ``daemon_gone``: the check
    ``die_with_daemon`` returned, when this process already armed it (a spare: spare.py).
    ``files``: a loader kept for more jobs (streamloader.py) reads one-part loads through the
    file it keeps open, and keeps ``reply`` open. Returns whether the load succeeded."""
    daemon_gone = daemon_gone or die_with_daemon(job.daemon_pid)
    if is_url(job.meta.source_path):  # an s3:// object: fetched by ranged GETs (remoteload.py)
        return run_remote_load(job.shm_dir, job.tmp_name, job.final_name, job.meta, job.checksum, reply, daemon_gone,
                               kept=files)
    set_process_name(LOADER_NAME)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when loads stop
    writer: SegmentWriter | None = None
    parts: Parts | None = None
    reservation: Reservation | None = None
    try:
        meta = job.meta
        t0 = time.monotonic_ns()
        rows = meta.row_range
        spans = _spans(job, rows)
        if files is not None and len(spans) > 1:
            files.close()  # no h5py handle crosses a fork
        # variable-length rows: created with no values (meta.values is the store's estimate), grown as read;
        # every byte reserved in a thread while this process and its parts get ready (reserve.py)
        writer = create_segment(job.shm_dir, job.tmp_name, replace(meta, values=0) if meta.vlen else meta,
                                reserve=False)
        started = time.monotonic_ns()
        parts = Parts(len(spans)) if len(spans) > 1 else None
        reservation = Reservation(writer, parts.mark_reserved if parts is not None else lambda: None,
                                  inline=parts is None and meta.file_size <= INLINE_RESERVE_BYTES)
        if parts is not None:
            _fork_parts(job, spans, writer, parts, daemon_gone, reply)
        progress = _Progress(writer, parts, daemon_gone)
        kept = files is not None and parts is None and not meta.files
        # opened after the forks, kept for the page cache drop
        with nullcontext(files.open(meta)) if kept and files is not None else open_source(meta) as source:
            if meta.vlen:
                reservation.wait()
                first = PartResult(0, load_vlen(source, meta, writer, progress, job.checksum, job.room,
                                                virtual_ok=job.virtual_ok)[0])
            else:
                first = _read_part(meta, rows, writer, spans[0], progress, job.checksum, reservation.wait, source,
                                   job.drop_page_cache, files.places if kept and files is not None else None,
                                   virtual_ok=job.virtual_ok)
            copied = first.copied
            finished = [time.monotonic_ns()]
            _wait_for_parts(parts, progress, daemon_gone)
            if parts is not None:
                finished += parts.finished[1:].tolist()
                copied += int(parts.copied[1:].sum())
            read_done = time.monotonic_ns()
            # every part is reaped: nothing writes into the rows any more
            checksum = writer.store_checksum(_joined_crc(first, spans, parts, writer)) if job.checksum else ""
            # (a multi-file load dropped each file's pages as it was read; vlen: the rows' values
            # sit in HDF5's heaps, which data_extents does not describe)
            drop = job.drop_page_cache and not meta.files and not meta.vlen
            fd, extents = _read_extents(source, meta, rows) if drop else (-1, [])
            reserved = max(reservation.done_ns, started)  # the rows could be written from then on
            stats = LoadStats(parts=len(spans), create_s=(started - t0) / 1e9 + reservation.seconds,
                              copied_bytes=copied, read_s=(read_done - reserved) / 1e9,
                              part_s=tuple((t - started) / 1e9 for t in finished),
                              checksum=checksum, checksum_s=(time.monotonic_ns() - read_done) / 1e9,
                              page_cache_drop_bytes=sum(size for _, size in extents), values=writer.meta.values)
            if not identities_unchanged(meta.identities()):
                raise SourceChanged(f"{meta.source_path} changed while it was being loaded; request it again")
            if daemon_gone():
                raise DaemonGone()
            published = writer.publish(job.final_name)
            writer = None
            reply.send(LoadOk(stats, published.name))
            # after the reply: the segment is ready for its jobs while the pages go
            drop_cached(fd, extents)
            return True
    except BaseException as exc:  # report everything: the daemon turns it into an error reply
        _abort(exc, parts, reservation, writer, files, reply)
        return False
    finally:
        if parts is not None:
            parts.kill_all()
        if files is None:
            reply.close()


def start_load(ctx: multiprocessing.context.ForkServerContext,
               job: LoadJob) -> tuple[multiprocessing.context.ForkServerProcess, Connection]:
    """Start a loader process for ``job``; the returned pipe end receives
    one LoadOk or LoadError (nothing when the loader stopped because the daemon is gone)."""
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=run_load, args=(job, sender), name=f"h5serve-load-{job.meta.key}-r{job.meta.rank}",
                          daemon=True)
    process.start()
    sender.close()
    return process, receiver
