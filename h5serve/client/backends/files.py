"""Many files as one dataset, read lazily through h5py (no daemon, or fallback="lazy"), from
the files' DatasetDescription (h5serve/hdf5/description.py: inspected and checked once, by the
dataset, before this backend is built).

The same rows in the same order as the daemon's segments: the files' rows concatenated
(h5serve.hdf5.files), the shard a RowRange over them, each file's part of it a ``Piece``. A batch
is gathered piece by piece: through a chunk cache per file when the shard fits the budget,
else read a chunk run at a time, as one file's lazy backend does. Variable-length rows: each
piece's rows of the batch gathered (a VlenCache per piece, or one h5py read), then put in the
batch's order with one more vectorised gather. At most MAX_OPEN_FILES
h5py handles stay open per process (least recently used closed first).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from ...hdf5.description import DatasetDescription
from ...hdf5.files import pieces
from ...hdf5.reads import read_rows
from ...hdf5.vlen import gather as vlen_gather
from ...hdf5.vlen import offsets_of
from ..gather import as_column
from ..ragged import RaggedColumn, read_ragged
from ..spec import BackendSpec
from .chunkcache import ChunkCache, auto_cache_bytes
from .handle import H5Handle
from .protocol import NoHooks
from .vlencache import VlenCache

__all__ = ["FilesLazyBackend", "FileHandles", "MAX_OPEN_FILES"]

log = logging.getLogger("h5serve.client")
MAX_OPEN_FILES = 64  # h5py handles one process keeps open at once (each is a descriptor and HDF5 caches)


class FileHandles:
    """One H5Handle per file, opened on first use, at most MAX_OPEN_FILES open at once."""

    def __init__(self, paths: tuple[str, ...], options: dict[str, Any], description: DatasetDescription | None = None,
                 ) -> None:
        self.paths = paths
        self.options = options
        self.pins = description.remote if description is not None else ()  # remote files' identities, as described
        self._open: OrderedDict[int, H5Handle] = OrderedDict()

    def get(self, index: int) -> H5Handle:
        handle = self._open.get(index)
        if handle is None:
            if len(self._open) >= MAX_OPEN_FILES:
                self._open.popitem(last=False)[1].close()
            handle = self._open[index] = H5Handle(self.paths[index], self.options,
                                                  self.pins[index] if self.pins else None)
        else:
            self._open.move_to_end(index)
        return handle

    def close(self) -> None:
        for handle in self._open.values():
            handle.close()
        self._open.clear()

    def __getstate__(self) -> dict[str, Any]:
        return {"paths": self.paths, "options": self.options, "pins": self.pins, "_open": OrderedDict()}


class FilesLazyBackend(NoHooks):
    """A multi-file dataset's shard read through h5py (see the module docstring)."""

    name = "lazy"

    def __init__(self, spec: BackendSpec, description: DatasetDescription) -> None:
        self.spec = spec
        self.infos = [key.infos for key in description.keys]  # infos[k][i]: key k of file i
        self.out_dtypes = description.out_dtypes
        self.total_rows = description.total_rows
        self.vlen_kinds = description.vlen_kinds  # the files agree (hdf5.files.check_agreement)
        self.rows = spec.selection.rows(self.total_rows)
        self.indices = spec.selection.indices(self.total_rows)
        self.pieces = pieces(self.rows, description.file_rows)
        self._starts = np.array([p.k0 for p in self.pieces], dtype=np.int64)
        budget = auto_cache_bytes() if spec.cache_bytes is None else spec.cache_bytes
        need = sum((VlenCache if infos[0].vlen else ChunkCache).nbytes_for(infos[p.index], p.local)
                   for infos in self.infos for p in self.pieces)
        self.cached = need <= budget
        if not self.cached:
            log.info("h5serve: the shard (%d MiB) is over the lazy cache budget (%d MiB): reading rows "
                     "uncached, which is slower; pass cache_bytes= to change it", need >> 20, budget >> 20)
        self.handles = FileHandles(spec.files, dict(spec.h5_options), description)
        self._caches: dict[tuple[int, int], ChunkCache | VlenCache] = {}

    def _cache(self, k: int, j: int) -> ChunkCache | VlenCache:
        cache = self._caches.get((k, j))
        if cache is None:
            piece = self.pieces[j]
            info = self.infos[k][piece.index]
            cache = self._caches[(k, j)] = (VlenCache if info.vlen else ChunkCache)(info, piece.local,
                                                                                     self.out_dtypes[k])
        return cache

    def gather(self, positions: torch.Tensor) -> list[torch.Tensor | np.ndarray | RaggedColumn]:
        pos = positions.numpy()
        which = np.searchsorted(self._starts, pos, "right") - 1
        groups = [(j, np.flatnonzero(which == j)) for j in np.unique(which).tolist()]
        return [self._gather_vlen(k, groups, pos) if self.vlen_kinds[k] else self._gather_fixed(k, groups, pos)
                for k in range(len(self.infos))]

    def _gather_fixed(self, k: int, groups: list[tuple[int, np.ndarray]], pos: np.ndarray) -> torch.Tensor | np.ndarray:
        d = self.out_dtypes[k]
        out = np.empty((len(pos), *self.infos[k][0].row_shape), dtype=d)
        for j, at in groups:
            piece = self.pieces[j]
            local = pos[at] - piece.k0
            handle = self.handles.get(piece.index)
            if self.cached:
                column = self._cache(k, j).take(handle.dataset, torch.from_numpy(local))
                out[at] = column.numpy() if isinstance(column, torch.Tensor) else column  # byte strings: arrays
            else:
                dset, stored = handle.located(self.infos[k][piece.index])
                out[at] = read_rows(dset, self.infos[k][piece.index], piece.local.start + local * piece.local.step, d,
                                    stored)
        return as_column(out)

    def _gather_vlen(self, k: int, groups: list[tuple[int, np.ndarray]], pos: np.ndarray) -> RaggedColumn:
        """Each file's rows of the batch (a vectorised gather each), then one more gather into
        the batch's order."""
        d, kind = self.out_dtypes[k], self.vlen_kinds[k]
        columns: list[RaggedColumn] = []
        order = []
        for j, at in groups:
            piece = self.pieces[j]
            local = pos[at] - piece.k0
            handle = self.handles.get(piece.index)
            info = self.infos[k][piece.index]
            if self.cached:
                cache = self._cache(k, j)
                assert isinstance(cache, VlenCache)
                column = cache.take(handle.dataset, torch.from_numpy(local))
            else:
                column = read_ragged(handle.dataset(info.key), info, piece.local.start + local * piece.local.step, d)
            columns.append(column)
            order.append(at)
        if len(columns) == 1:  # one file: already in the batch's order
            return columns[0]
        if not columns:
            return RaggedColumn(np.empty(0, dtype=d), np.zeros(0, dtype=np.int64), kind)
        where = np.empty(len(pos), dtype=np.int64)
        where[np.concatenate(order)] = np.arange(len(pos))
        flat, lengths = vlen_gather(offsets_of(np.concatenate([c.lengths for c in columns])),
                                    np.concatenate([c.values for c in columns]), where)
        return RaggedColumn(flat, lengths, kind)

    def close(self) -> None:
        self.handles.close()
        self._caches = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_caches": {}}  # a spawned worker fills its own caches
