"""Reading HDF5 sources with h5py: identity, validation, chunk-aligned block reads.

Shared by the daemon's loader, the lazy client backend and the in-memory compat backend, so
the three read the same rows the same way and cast with the same numpy rule (never HDF5's own
conversion, which can differ from numpy's for out-of-range values).

h5py errors are translated to h5serve errors here, in one place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterator

import h5py
import numpy as np

from .errors import ConfigError, KeyNotFound, LengthMismatch, SourceNotFound, UnsupportedDataset
from .sharding import Selection

__all__ = [
    "FileIdentity",
    "DatasetInfo",
    "file_identity",
    "open_h5",
    "inspect_dataset",
    "check_lengths",
    "resolve_dtype",
    "storage_dtype",
    "read_shard_into",
    "read_rows",
]

BLOCK_BYTES = 32 * 1024 * 1024  # rows per read are chunk-aligned and about this large
SERVABLE_KINDS = "biufc"


@dataclass(frozen=True)
class FileIdentity:
    """(realpath, st_dev, st_ino, st_size, st_mtime_ns): changes whenever the file does."""

    path: str
    dev: int
    ino: int
    size: int
    mtime_ns: int

    def as_tuple(self) -> tuple[str, int, int, int, int]:
        return (self.path, self.dev, self.ino, self.size, self.mtime_ns)


@dataclass(frozen=True)
class DatasetInfo:
    key: str
    rows: int
    row_shape: tuple[int, ...]
    dtype: np.dtype  # native byte order
    chunk_rows: int  # rows per chunk along axis 0 (the whole dataset if not chunked)
    linked_file: str = ""  # realpath of the file holding the data when reached by an external link


# Registered ids of common third-party HDF5 filters, to name them when their plugin is missing.
KNOWN_FILTERS = {32001: "blosc", 32004: "lz4", 32008: "bitshuffle", 32015: "zstd", 32026: "blosc2", 307: "bzip2"}


def file_identity(path: str | os.PathLike[str]) -> FileIdentity:
    """Raised when the file does not exist or is not a regular file: SourceNotFound."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError as exc:
        raise SourceNotFound(
            f"HDF5 file {os.fspath(path)!r} cannot be read: {exc.strerror}; check the path "
            f"(relative paths are resolved from {os.getcwd()})"
        ) from exc
    if not os.path.isfile(real):
        raise SourceNotFound(f"{os.fspath(path)!r} is not a regular file; pass the path of an HDF5 file")
    return FileIdentity(real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def sources_unchanged(source: tuple, linked: tuple = ()) -> bool:
    """True when the file (and the externally linked file, if any) still has the identity
    ``(path, dev, ino, size, mtime_ns)`` recorded when its rows were loaded."""
    try:
        if file_identity(source[0]).as_tuple() != tuple(source):
            return False
        return not linked or file_identity(linked[0]).as_tuple() == tuple(linked)
    except SourceNotFound:
        return False


def open_h5(path: str | os.PathLike[str], **kwargs: object) -> h5py.File:
    """Open read-only. Raised when missing or not HDF5: SourceNotFound."""
    file_identity(path)
    try:
        return h5py.File(path, "r", **kwargs)
    except OSError as exc:
        raise SourceNotFound(f"{os.fspath(path)!r} cannot be opened as an HDF5 file: {exc}") from exc


def _dataset_names(f: h5py.File, limit: int = 30) -> list[str]:
    names: list[str] = []

    def visit(name: str, obj: object) -> None:
        if isinstance(obj, h5py.Dataset) and len(names) < limit:
            names.append(name)

    f.visititems(visit)
    return names


def resolve_dtype(dtype: object, what: str) -> np.dtype | None:
    """A requested dtype as a servable numpy dtype (native order), or None.

    Raised when it is not a numeric dtype numpy knows: ConfigError.
    """
    if dtype is None:
        return None
    try:
        resolved = np.dtype(dtype)
    except TypeError as exc:
        raise ConfigError(f"{what}={dtype!r} is not a numpy dtype; use e.g. 'float32' or np.float32") from exc
    if resolved.kind not in SERVABLE_KINDS or resolved.fields is not None:
        raise ConfigError(f"{what}={resolved} is not a numeric dtype; use a bool, integer or float dtype")
    return resolved.newbyteorder("=")


def inspect_dataset(f: h5py.File, key: str) -> DatasetInfo:
    """Shape, dtype and chunking of ``f[key]``.

    Raised when the key is missing (the message lists datasets that exist): KeyNotFound.
    Raised when it has no rows dimension or a dtype that is not plain numeric: UnsupportedDataset.
    """
    try:
        obj = f.get(key)
    except (KeyError, ValueError, OSError) as exc:  # broken links, bad names
        raise KeyNotFound(f"key {key!r} cannot be opened in {f.filename}: {exc}") from exc
    if obj is None:
        names = _dataset_names(f)
        raise KeyNotFound(
            f"key {key!r} is not in {f.filename}; datasets there: {', '.join(names) or '(none)'}"
        )
    if not isinstance(obj, h5py.Dataset):
        raise KeyNotFound(f"key {key!r} in {f.filename} is a group, not a dataset; pass a dataset path like '{key}/...'")
    if obj.shape is None or len(obj.shape) == 0:
        raise UnsupportedDataset(f"dataset {key!r} in {f.filename} is scalar: it has no rows dimension to shard")
    dtype = obj.dtype
    if h5py.check_string_dtype(dtype) is not None or h5py.check_vlen_dtype(dtype) is not None:
        raise UnsupportedDataset(f"dataset {key!r} has dtype {dtype} (strings / variable length): only numeric data is served")
    if dtype.kind not in SERVABLE_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise UnsupportedDataset(f"dataset {key!r} has dtype {dtype}: only bool, integer and float data is served")
    if dtype.kind in "fc" and dtype.itemsize > (8 if dtype.kind == "f" else 16):
        raise UnsupportedDataset(f"dataset {key!r} has dtype {dtype}: extended precision cannot be served")
    _check_filters(obj, key)
    chunks = obj.chunks
    holder = os.path.realpath(obj.file.filename)
    return DatasetInfo(
        key=key,
        rows=int(obj.shape[0]),
        row_shape=tuple(int(n) for n in obj.shape[1:]),
        dtype=dtype.newbyteorder("="),
        chunk_rows=int(chunks[0]) if chunks else max(int(obj.shape[0]), 1),
        linked_file="" if holder == os.path.realpath(f.filename) else holder,
    )


def _check_filters(obj: h5py.Dataset, key: str) -> None:
    """Raised when a filter the dataset needs is not available here: UnsupportedDataset."""
    plist = obj.id.get_create_plist()
    for i in range(plist.get_nfilters()):
        filter_id, _flags, _values, raw_name = plist.get_filter(i)
        if not h5py.h5z.filter_avail(filter_id):
            name = KNOWN_FILTERS.get(filter_id) or raw_name.decode(errors="replace") or "unknown"
            raise UnsupportedDataset(
                f"dataset {key!r} is compressed with HDF5 filter {name!r} (id {filter_id}), which is not "
                "available here; install its plugin (`pip install hdf5plugin`, imported before h5py reads) "
                "or rewrite the dataset with gzip/lzf"
            )


def check_lengths(x: DatasetInfo, y: DatasetInfo | None) -> None:
    """Raised when x and y have different row counts: LengthMismatch."""
    if y is not None and y.rows != x.rows:
        raise LengthMismatch(
            f"x {x.key!r} has {x.rows} rows but y {y.key!r} has {y.rows}: they must have the same length"
        )


def storage_dtype(source: np.dtype, requested: np.dtype | None) -> np.dtype:
    """What a segment stores: the narrower of source and requested, so a widening cast
    (uint8 -> float32) never multiplies node memory; the cast then happens per batch."""
    if requested is None or requested == source:
        return source
    return source if source.itemsize < requested.itemsize else requested


def _blocks(start: int, end: int, info: DatasetInfo) -> Iterator[tuple[int, int]]:
    row_bytes = max(int(np.prod(info.row_shape, dtype=np.int64)) * info.dtype.itemsize, 1)
    step = max(BLOCK_BYTES // row_bytes // info.chunk_rows, 1) * info.chunk_rows
    a = start
    while a < end:
        b = min((a // info.chunk_rows + 1) * info.chunk_rows + step - info.chunk_rows, end)
        yield a, b
        a = b


def read_shard_into(
    dset: h5py.Dataset,
    info: DatasetInfo,
    selection: Selection,
    out: np.ndarray,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Fill ``out`` with the shard's rows, cast to ``out.dtype``, in chunk-aligned blocks.

    Contiguous shards with no cast are read straight into ``out`` (no intermediate copy);
    interleaved shards read contiguous blocks and stride them in memory (h5py is slow at
    ``d[r::W]``).
    """
    indices = selection.indices(info.rows)
    if len(indices) == 0:
        return
    first, last = int(indices[0]), int(indices[-1]) + 1
    W = selection.world_size if selection.mode == "interleave" else 1
    done = 0
    buffer: np.ndarray | None = None
    for a, b in _blocks(first, last, info):
        # rows of this shard in [a, b): global rows first + k*W
        k0 = -(-(a - first) // W)
        k1 = -(-(b - first) // W)
        if k1 <= k0:
            continue
        if W == 1 and out.dtype == info.dtype:
            dset.read_direct(out, np.s_[a:b], np.s_[k0:k1])
        else:
            if buffer is None or buffer.shape[0] < b - a:
                buffer = np.empty((b - a, *info.row_shape), dtype=info.dtype)
            block = buffer[: b - a]
            dset.read_direct(block, np.s_[a:b], np.s_[0:b - a])
            np.copyto(out[k0:k1], block[first + k0 * W - a :: W][: k1 - k0], casting="unsafe")
        done = k1
        if progress is not None:
            progress(done)


def read_rows(dset: h5py.Dataset, info: DatasetInfo, rows: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Rows ``rows`` (any order, repeats allowed) as a fresh array of ``dtype``.

    Reads each distinct row once, in increasing order (h5py needs sorted unique indices):
    one slice when the rows are dense, else one point selection.
    """
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size == 0:
        return np.empty((0, *info.row_shape), dtype=dtype)
    unique, inverse = np.unique(rows, return_inverse=True)
    lo, hi = int(unique[0]), int(unique[-1]) + 1
    if hi - lo <= 4 * len(unique):
        block = np.empty((hi - lo, *info.row_shape), dtype=info.dtype)
        dset.read_direct(block, np.s_[lo:hi], np.s_[0:hi - lo])
        data = block[unique - lo]
    else:
        data = np.asarray(dset[unique.tolist()], dtype=info.dtype)
    out = data[inverse.reshape(-1)]
    return out if out.dtype == dtype else out.astype(dtype)
