"""Many files as one dataset, read lazily through h5py (no daemon, or fallback="lazy").

The same rows in the same order as the daemon's segments: the files' rows concatenated
(h5serve.files), the shard a RowRange over them, each file's part of it a ``Piece``. A batch
is gathered piece by piece: through a chunk cache per file when the shard fits the budget,
else read a chunk run at a time, as one file's lazy backend does. At most MAX_OPEN_FILES
h5py handles stay open per process (least recently used closed first).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..files import check_agreement, check_file_lengths, pieces
from ..reads import read_rows, read_shard_into, row_bytes
from ..source import DatasetInfo, inspect_dataset, open_h5
from .chunkcache import ChunkCache, auto_cache_bytes

if TYPE_CHECKING:
    from .backends import BackendSpec, H5Handle

__all__ = ["FilesLazyBackend", "MAX_OPEN_FILES"]

log = logging.getLogger("h5serve.client")
MAX_OPEN_FILES = 64  # h5py handles one process keeps open at once (each is a descriptor and HDF5 caches)


class _Handles:
    """One H5Handle per file, opened on first use, at most MAX_OPEN_FILES open at once."""

    def __init__(self, paths: tuple[str, ...], options: dict[str, Any]) -> None:
        self.paths = paths
        self.options = options
        self._open: OrderedDict[int, "H5Handle"] = OrderedDict()

    def get(self, index: int) -> "H5Handle":
        from .backends import H5Handle

        handle = self._open.get(index)
        if handle is None:
            if len(self._open) >= MAX_OPEN_FILES:
                self._open.popitem(last=False)[1].close()
            handle = self._open[index] = H5Handle(self.paths[index], self.options)
        else:
            self._open.move_to_end(index)
        return handle

    def close(self) -> None:
        for handle in self._open.values():
            handle.close()
        self._open.clear()

    def __getstate__(self) -> dict[str, Any]:
        return {"paths": self.paths, "options": self.options, "_open": OrderedDict()}


def inspect_files(spec: "BackendSpec") -> list[list[DatasetInfo]]:
    """``infos[k][i]``: key ``k`` of file ``i``, each file opened once and closed.

    Raised when a file or key is missing or cannot be served: the DataError naming that file.
    """
    infos: list[list[DatasetInfo]] = [[] for _ in spec.keys]
    for path in spec.files:
        with open_h5(path) as f:
            for k, key in enumerate(spec.keys):
                infos[k].append(inspect_dataset(f, key))
    return infos


class FilesLazyBackend:
    """A multi-file dataset's shard read through h5py (see the module docstring)."""

    name = "lazy"

    def __init__(self, spec: "BackendSpec") -> None:
        self.spec = spec
        self.infos = inspect_files(spec)
        set_dtypes = [check_agreement(spec.files, infos, requested) for infos, requested in zip(self.infos, spec.dtypes)]
        counts = [[info.rows for info in infos] for infos in self.infos]
        check_file_lengths(spec.files, spec.keys, counts)
        self.out_dtypes = [requested or dtype for dtype, requested in zip(set_dtypes, spec.dtypes)]
        self.total_rows = sum(counts[0])
        self.vlen_kinds = [""] * len(spec.keys)  # many files of variable-length rows are refused (files.check_agreement)
        self.rows = spec.selection.rows(self.total_rows)
        self.indices = spec.selection.indices(self.total_rows)
        self.pieces = pieces(self.rows, counts[0])
        self._starts = np.array([p.k0 for p in self.pieces], dtype=np.int64)
        budget = auto_cache_bytes() if spec.cache_bytes is None else spec.cache_bytes
        need = sum(len(self.rows) * row_bytes(infos[0]) for infos in self.infos)
        self.cached = need <= budget
        if not self.cached:
            log.info("h5serve: the shard (%d MiB) is over the lazy cache budget (%d MiB): reading rows "
                     "uncached, which is slower; pass cache_bytes= to change it", need >> 20, budget >> 20)
        self.handles = _Handles(spec.files, dict(spec.h5_options))
        self._caches: dict[tuple[int, int], ChunkCache] = {}

    def _cache(self, k: int, j: int) -> ChunkCache:
        cache = self._caches.get((k, j))
        if cache is None:
            piece = self.pieces[j]
            cache = self._caches[(k, j)] = ChunkCache(self.infos[k][piece.index], piece.local, self.out_dtypes[k])
        return cache

    def gather(self, positions: torch.Tensor) -> list[torch.Tensor]:
        pos = positions.numpy()
        which = np.searchsorted(self._starts, pos, "right") - 1
        out = [np.empty((len(pos), *infos[0].row_shape), dtype=d) for infos, d in zip(self.infos, self.out_dtypes)]
        for j in np.unique(which).tolist():
            at = np.flatnonzero(which == j)
            piece = self.pieces[j]
            local = pos[at] - piece.k0
            handle = self.handles.get(piece.index)
            for k, (infos, d) in enumerate(zip(self.infos, self.out_dtypes)):
                info = infos[piece.index]
                if self.cached:
                    out[k][at] = self._cache(k, j).take(handle.dataset, torch.from_numpy(local)).numpy()
                else:
                    dset, stored = handle.located(info)
                    out[k][at] = read_rows(dset, info, piece.local.start + local * piece.local.step, d, stored)
        return [torch.from_numpy(o) for o in out]

    def read_all(self) -> list[np.ndarray]:
        """The whole shard of every key, in the output dtypes (the compat dataset's private copy)."""
        arrays = [np.empty((len(self.rows), *infos[0].row_shape), dtype=d) for infos, d in zip(self.infos, self.out_dtypes)]
        for piece in self.pieces:
            with open_h5(self.spec.files[piece.index], **self.spec.h5_options) as f:
                for k, key in enumerate(self.spec.keys):
                    read_shard_into(f[key], self.infos[k][piece.index], piece.local, arrays[k][piece.k0:piece.k1])
        return arrays

    def close(self) -> None:
        self.handles.close()
        self._caches = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_caches": {}}  # a spawned worker fills its own caches
