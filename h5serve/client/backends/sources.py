"""Where a dataset's rows come from: shared memory, lazy h5py reads, or private memory.

Every backend answers ``gather(positions) -> [one column per key]`` with fresh, writable
tensors in the output dtypes (byte strings: NumPy arrays; variable-length rows: a
``RaggedColumn``), for an int64 tensor of valid local positions in this rank's shard.
``vlen_kinds`` says which keys hold variable-length rows (h5serve/hdf5/vlen.py). The shm
backend's rows are gathered out of a read-only mapping, so nothing a caller does to them can
reach another process.
"""

from __future__ import annotations

import io
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...errors import AccessDenied, SegmentError, UnsupportedDataset
from ...hdf5.compound import rows_dataset
from ...hdf5.description import DatasetDescription, check_rows
from ...hdf5.files import pieces
from ...hdf5.identity import open_h5
from ...hdf5.reads import read_rows, read_shard_into
from ...order.sharding import Selection
from ...segments import AttachedSegment, PublishStamp, open_segment
from ...util.progress import Progress
from ...wire.connection import DaemonClient
from ...wire.protocol import POLL_INTERVAL_S, Acquire, AcquireResult
from ...wire.runtime import resolve_runtime
from ..gather import RowSource, as_column
from ..ragged import RaggedColumn, RaggedSource, read_ragged
from ..spec import BackendSpec, describe_spec
from .attach import ATTACH_TRIES, EvictionRetry, attach_asking_again, check_same_shm, open_acquired
from .chunkcache import ChunkCache, auto_cache_bytes, hdf5_cache_options
from .files import FilesLazyBackend
from .handle import H5Handle
from .protocol import NoHooks
from .vlencache import VlenCache

__all__ = ["Acquires", "ShmBackend", "LazyBackend", "MemoryBackend", "lazy_backend"]


log = logging.getLogger("h5serve.client")


class ArrayBackend(NoHooks):
    """Rows held in arrays (a mapping or private memory): one vectorised gather per array."""

    name = "memory"

    def __init__(self, arrays: list[np.ndarray], out_dtypes: list[np.dtype], total_rows: int) -> None:
        self.out_dtypes = out_dtypes
        self.total_rows = total_rows
        self.vlen_kinds = [""] * len(arrays)
        self.arrays = arrays

    @property
    def arrays(self) -> list[np.ndarray]:
        return [source.array for source in self._sources]

    @arrays.setter
    def arrays(self, arrays: list[np.ndarray]) -> None:
        self._sources: list[RowSource | RaggedSource] = [RowSource(a, d) for a, d in zip(arrays, self.out_dtypes)]

    def gather(self, positions: torch.Tensor) -> list[torch.Tensor | np.ndarray | RaggedColumn]:
        return [source.take(positions) for source in self._sources]

    def close(self) -> None:
        self._sources = []


class MemoryBackend(ArrayBackend):
    """The predecessor's behaviour: the shard read once into this process's private memory."""

    @classmethod
    def load(cls, spec: BackendSpec, description: DatasetDescription) -> MemoryBackend:
        """Read ``spec``'s shard of the files ``description`` describes (many files: file by file).

        Raised for variable-length rows, which this copy does not hold: UnsupportedDataset.
        """
        for key in description.keys:
            if key.vlen:
                raise UnsupportedDataset(
                    f"dataset {key.key!r} in {description.files[0]} holds variable-length rows; SharedH5Dataset "
                    "serves variable-length rows, this reader (the compat preload) does not: use SharedH5Dataset"
                )
        rows = spec.selection.rows(description.total_rows)
        arrays = [np.empty((len(rows), *key.row_shape), dtype=key.out_dtype) for key in description.keys]
        for piece in pieces(rows, description.file_rows):
            with open_h5(description.files[piece.index], **spec.h5_options) as f:
                for key, out in zip(description.keys, arrays):
                    # a compound field: read through the helper every other path reads with
                    read_shard_into(rows_dataset(f, key.key), key.infos[piece.index], piece.local,
                                    out[piece.k0:piece.k1])
        return cls(arrays, description.out_dtypes, description.total_rows)


@dataclass
class Acquires:
    """One shard's acquires, sent (``ShmBackend.start``: their loads started), and the daemon's
    latest answer to each; ``ShmBackend.attach_ready`` maps them once every one is ready."""

    spec: BackendSpec
    client: DaemonClient
    requests: list[Acquire]
    results: list[AcquireResult]

    @property
    def ready(self) -> bool:
        return all(r.state == "ready" for r in self.results)

    def poll(self, timeout: float) -> bool:
        """Ask once more about every segment not ready yet, waiting at most ``timeout`` for each
        answer (no retry); True once every one is ready.

        Raised when the daemon does not answer in time or is gone: DaemonUnavailable. Raised
        when a load failed: the daemon's error class."""
        self.results = [r if r.state == "ready" else
                        AcquireResult.from_wire(self.client.request(q, timeout=timeout, retries=0))
                        for q, r in zip(self.requests, self.results)]
        return self.ready


class ShmBackend(ArrayBackend):
    """Segments loaded by the daemon, mapped read-only; the lease is held while attached.
    ``runtime_dir``: the daemon's, where a spawned worker asks again for the descriptors
    (segments/handout.py: a process not of the daemon's uid cannot open them by name)."""

    name = "shm"

    def __init__(self, spec: BackendSpec, segments: list[AttachedSegment], runtime_dir: str = "") -> None:
        out = [requested or np.dtype(s.meta.source_dtype) for s, requested in zip(segments, spec.dtypes)]
        super().__init__([s.data for s in segments], out, segments[0].meta.total_rows)
        self.spec = spec
        self.segments = segments
        self.runtime_dir = runtime_dir or str(resolve_runtime(spec.runtime_dir).directory)
        self.vlen_kinds = [s.meta.vlen for s in segments]
        if any(self.vlen_kinds):  # offsets (``data``) and values: gathered by RaggedSource
            self._sources = [_ragged_source(s, d) if s.meta.vlen else source
                             for s, d, source in zip(segments, out, self._sources)]

    @classmethod
    def connect(cls, spec: BackendSpec, rank_for_logs: int = 0) -> ShmBackend:
        """Ask the daemon for the shard's segments (loading them if needed) and attach.

        ``spec.timeout`` bounds the whole of it (every request, the wait for the loads, the
        attach); None: each request within the default timeout, and the loads as long as they
        make progress (the daemon stops a stalled one: its ``--stall-timeout``).

        Raised when no daemon answers, or the loads are not done within ``spec.timeout``:
        DaemonUnavailable. Raised when the keys differ in length: LengthMismatch. Other
        daemon errors arrive as their own classes.
        """
        deadline = None if spec.timeout is None else time.monotonic() + spec.timeout
        with DaemonClient(spec.runtime_dir, spec.timeout, spec.daemon_user) as client:
            started = cls.start(spec, client, deadline)
            segments: list[AttachedSegment] = []
            try:
                for request, result in zip(started.requests, started.results):
                    segments.append(cls._attach(client, request, result, rank_for_logs, deadline))
                return cls._checked(spec, segments, client)
            except BaseException:
                for segment in segments:  # one key attached but another failed: drop x's lease now, not at GC
                    segment.close()
                raise

    @staticmethod
    def start(spec: BackendSpec, client: DaemonClient, deadline: float | None = None,
              resolved: bool = False) -> Acquires:
        """Send the shard's acquires, which starts every load, without waiting for them;
        ``resolved``: ask again until the daemon has resolved every key (a refusal for room,
        BudgetExceeded, comes then), as it always does for many files.

        Raised as ``connect`` is, for what the daemon answers at once.
        """
        requests = [
            Acquire(spec.path, key, spec.selection.world_size, spec.selection.rank, spec.selection.mode,
                    None if dtype is None else dtype.str, spec.selection.span, spec.files, pin=spec.pin,
                    pins=spec.pins)
            for key, dtype in zip(spec.keys, spec.dtypes)
        ]
        first = [AcquireResult.from_wire(client.request_by(r, deadline)) for r in requests]  # starts every load
        while (spec.files or resolved) and not all(r.name for r in first):
            # many files take the daemon a while to resolve: ask for every key until each has
            # its load started, so that they resolve and load side by side, not one after another
            time.sleep(POLL_INTERVAL_S)
            first = [r if r.name else AcquireResult.from_wire(client.request_by(q, deadline))
                     for q, r in zip(requests, first)]
        if all(r.name for r in first):  # both resolved already (else: checked once attached)
            check_rows(spec.keys, [r.dataset_rows for r in first])
        return Acquires(spec, client, requests, first)

    @classmethod
    def attach_ready(cls, started: Acquires) -> ShmBackend:
        """The segments of acquires the daemon answered ``ready`` (``started.ready``), mapped
        now, never waiting for a load.

        Raised when one cannot be mapped (evicted or changed since the answer): SegmentError;
        as ``connect`` for the rest.
        """
        segments: list[AttachedSegment] = []
        try:
            for request, result in zip(started.requests, started.results):
                check_same_shm(result)
                segments.append(cls._holds(open_acquired(started.client, result), request, result))
            return cls._checked(started.spec, segments, started.client)
        except BaseException:
            for segment in segments:
                segment.close()
            raise

    @classmethod
    def _checked(cls, spec: BackendSpec, segments: list[AttachedSegment], client: DaemonClient) -> ShmBackend:
        # many files: equal totals are not enough, rows must pair up file by file
        check_rows(spec.keys, [s.meta.total_rows for s in segments], spec.files, [s.meta.file_rows for s in segments])
        return cls(spec, segments, str(client.location.directory))

    @staticmethod
    def _attach(client: DaemonClient, request: Acquire, result: AcquireResult, rank_for_logs: int,
                deadline: float | None = None) -> AttachedSegment:
        bar: list[Progress] = []

        def progress(result: AcquireResult) -> None:
            if not result.rows_total:  # the daemon is still opening the file
                return
            if not bar:  # rank 0 shows a bar (or log lines); other ranks log at debug level
                emit = log.info if rank_for_logs == 0 else log.debug
                stream = None if rank_for_logs == 0 else io.StringIO()
                bar.append(Progress(f"rank {rank_for_logs}: loading {request.key} into shm", result.rows_total,
                                    emit, stream))
            bar[0].update(result.rows_done)

        try:
            return ShmBackend._attach_ready(client, request, result, progress, deadline)
        finally:
            for b in bar:
                b.close()

    @staticmethod
    def attach_one(client: DaemonClient, request: Acquire, result: AcquireResult,
                   deadline: float | None = None) -> AttachedSegment:
        """One key's segment, mapped and checked to hold ``request``'s rows, waiting for its load
        when ``result`` is not ready (stream mode's keys held whole).

        Raised as ``connect`` is."""
        return ShmBackend._attach_ready(client, request, result, lambda _result: None, deadline)

    @staticmethod
    def _attach_ready(client: DaemonClient, request: Acquire, result: AcquireResult,
                      progress: Callable[[AcquireResult], None], deadline: float | None = None) -> AttachedSegment:
        check_same_shm(result)
        segment, result = attach_asking_again(client, result, lambda: client.acquire(request, progress, deadline),
                                              EvictionRetry(tries=ATTACH_TRIES))
        return ShmBackend._holds(segment, request, result)

    @staticmethod
    def _holds(segment: AttachedSegment, request: Acquire, result: AcquireResult) -> AttachedSegment:
        """``segment``, checked to hold the rows ``request`` asked for (else closed: SegmentError)."""
        m = segment.meta
        wanted = Selection(request.mode, request.world_size, request.rank, request.span).rows(m.total_rows)
        pinned = request.pin is None or (m.source_path, m.source_size, *m.remote) == (request.path, *request.pin)
        if request.pins:  # many objects: each file's URL, size, ETag and version id as described
            pinned = [(f[0], f[3], *m.remote[2 * i:2 * i + 2]) for i, f in enumerate(m.files)] == [
                (path, size, etag, version) for path, (size, etag, version) in zip(request.files, request.pins)]
        if m.key != request.key or m.row_range != wanted or len(m.files) != len(request.files) or not pinned:
            # rows, not labels: selections share segments
            segment.close()
            raise SegmentError(f"segment {result.name} does not hold rows {wanted} of {request.key!r} "
                               f"({request.mode} rank {request.rank}/{request.world_size})")
        return segment

    def close(self) -> None:
        super().close()
        for segment in self.segments:
            segment.close()
        self.segments = []

    def __reduce__(self) -> tuple[Any, ...]:
        where = [(str(s.path.parent), s.name, s.owner, s.stamp.ino, s.stamp.ctime_ns) for s in self.segments]
        return (_reattach, (self.spec, where, self.runtime_dir))


def _ragged_source(segment: AttachedSegment, out_dtype: np.dtype) -> RaggedSource:
    if segment.values is None:  # the header says variable-length rows, the file has no values part
        raise SegmentError(f"segment {segment.path} holds variable-length rows without their values: "
                           "it is damaged; the daemon loads it again once it is removed")
    return RaggedSource(segment.data, segment.values, out_dtype, segment.meta.vlen)


def _reattach(spec: BackendSpec, where: list[tuple[str, str, int, int, int]],
              runtime_dir: str) -> ArrayBackend | LazyBackend | FilesLazyBackend:
    """Unpickling in a spawned worker: map the same files again (the very files the parent
    mapped: same inode and ctime), by name or from the daemon's descriptors as the parent did.
    If they are gone (the daemon stopped, evicted or reloaded them) or refused, read the same
    rows lazily instead: never fail a worker."""
    segments: list[AttachedSegment] = []
    try:
        for shm_dir, name, owner, ino, ctime_ns in where:
            segments.append(open_segment(runtime_dir, shm_dir, name, owner, PublishStamp(ino, ctime_ns)))
        return ShmBackend(spec, segments, runtime_dir)
    except (SegmentError, AccessDenied) as exc:
        for segment in segments:
            segment.close()
        log.warning("could not re-attach h5serve segments in pid %d (%s); reading lazily", os.getpid(), exc)
        return lazy_backend(spec)


def lazy_backend(spec: BackendSpec, description: DatasetDescription | None = None) -> LazyBackend | FilesLazyBackend:
    """The lazy backend for ``spec``: one file's, or many files' (client/backends/files.py), given the
    files' ``description`` (None: described here, each file opened once).

    Raised as hdf5.description.describe is when ``description`` is None.
    """
    if description is None:
        description = describe_spec(spec)
    if spec.files:
        return FilesLazyBackend(spec, description)
    return LazyBackend(spec, description)


class LazyBackend(NoHooks):
    """Rows read through h5py on demand: through a chunk cache when the shard fits the
    budget (``spec.cache_bytes``; None: the rank's share of half the node's available memory), else one read per run
    of rows of a chunk, uncached, with an HDF5 chunk cache sized from the chunk shape."""

    name = "lazy"

    def __init__(self, spec: BackendSpec, description: DatasetDescription) -> None:
        self.spec = spec
        self.infos = description.infos
        self.out_dtypes = description.out_dtypes
        self.total_rows = description.total_rows
        self.vlen_kinds = description.vlen_kinds
        self.indices = spec.selection.indices(self.total_rows)
        budget = auto_cache_bytes() if spec.cache_bytes is None else spec.cache_bytes
        self.rows = spec.selection.rows(self.total_rows)
        need = sum((VlenCache if info.vlen else ChunkCache).nbytes_for(info, self.rows) for info in self.infos)
        self.cached = need <= budget
        options = dict(spec.h5_options)
        if not self.cached:
            options = {**hdf5_cache_options(self.infos[0], budget), **options}
            log.info("h5serve: the shard (%d MiB) is over the lazy cache budget (%d MiB): reading rows "
                     "uncached, which is slower; pass cache_bytes= to change it", need >> 20, budget >> 20)
        self.handle = H5Handle(spec.path, options, description.pin(0))
        self._caches: list[ChunkCache | VlenCache] | None = None

    def _chunk_caches(self) -> list[ChunkCache | VlenCache]:
        if self._caches is None:
            self._caches = [(VlenCache if info.vlen else ChunkCache)(info, self.rows, d)
                            for info, d in zip(self.infos, self.out_dtypes)]
        return self._caches

    def gather(self, positions: torch.Tensor) -> list[torch.Tensor | np.ndarray | RaggedColumn]:
        if self.cached:
            return [cache.take(self.handle.dataset, positions) for cache in self._chunk_caches()]
        rows = self.indices[positions.numpy()]
        out: list[torch.Tensor | np.ndarray | RaggedColumn] = []
        for info, d in zip(self.infos, self.out_dtypes):
            if info.vlen:  # one h5py read of the batch's rows, each once, in increasing order
                out.append(read_ragged(self.handle.dataset(info.key), info, rows, d))
            else:
                dset, stored = self.handle.located(info)
                out.append(as_column(read_rows(dset, info, rows, d, stored)))
        return out

    def close(self) -> None:
        self.handle.close()
        self._caches = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_caches": None}  # a spawned worker fills its own cache


