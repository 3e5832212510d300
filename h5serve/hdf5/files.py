"""Many HDF5 files as one dataset: expanding the names, checking that the files agree, and
mapping the concatenated rows back to each file.

A multi-file dataset is the files' rows concatenated in the order given (a glob pattern is
expanded with the user's rights on the client and sorted): global row ``g`` is row
``g - offsets[i]`` of file ``i``. Every mode's RowRange (order/sharding.py) is over these global
rows, so a rank's rows may span several files; ``pieces`` cuts a RowRange into one piece per
file it touches, with the positions the piece fills in the shard.

Shared by the client (expansion, the lazy backend) and the daemon (validation, the loader),
torch-free and daemon-free.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError, DataError, LengthMismatch, ObjectNotFound, SourceNotFound
from ..order.sharding import RowRange
from ..wire.protocol import MAX_FILES, MAX_FILES_FRAME_BYTES, MAX_PATH_CHARS
from .remote import expand_url_pattern, is_url, parse_url, shown_url
from .source import DatasetInfo, check_cast
from .vlen import SEQ

__all__ = [
    "MAX_FILES",
    "MAX_FILES_PATH_BYTES",
    "FileSet",
    "Piece",
    "expand_paths",
    "check_file_list",
    "check_agreement",
    "check_file_lengths",
    "set_dtype",
    "pieces",
    "plan_file_parts",
    "describe_files",
]

# their paths' UTF-8 bytes, so that the acquire request naming them stays under the daemon's frame limit
MAX_FILES_PATH_BYTES = MAX_FILES_FRAME_BYTES - 64 * 1024
MIN_PART_FILES = 64  # a parallel load gives each process at least this many small files


@dataclass(frozen=True)
class FileSet:
    """What the user named: the files (absolute, in row order) and the pattern or list shown."""

    paths: tuple[str, ...]
    shown: str  # the glob pattern as given, or "" for an explicit list


def _is_pattern(text: str) -> bool:
    if is_url(text):  # an https URL's ? starts its query; s3:// and gs:// keys may hold patterns
        return parse_url(text)[0] not in ("http", "https") and glob.has_magic(text)
    return glob.has_magic(text)


def _absolute(text: str) -> str:
    """A local path made absolute; a URL as it is (checked: parse_url)."""
    if is_url(text):
        parse_url(text)
        return text
    return os.path.abspath(text)


def _expand_url(text: str) -> FileSet:
    matches = expand_url_pattern(text)
    if not matches:
        raise ObjectNotFound(f"pattern {shown_url(text)!r} matches no object; check it", url=shown_url(text))
    check_file_list(matches)
    return FileSet(tuple(matches), text)


def check_file_list(paths: Sequence[str]) -> None:
    """Raised when there are more files than one request can name, or a file is named twice:
    ConfigError."""
    if len(paths) > MAX_FILES:
        raise ConfigError(
            f"{len(paths)} files is more than the {MAX_FILES} one dataset may have; merge files, or make one HDF5 "
            "virtual dataset over them (h5py.VirtualLayout) and pass that file"
        )
    size = sum(len(os.fsencode(p)) + 2 for p in paths)
    if size > MAX_FILES_PATH_BYTES:
        raise ConfigError(
            f"the {len(paths)} file paths take {size} bytes, more than the {MAX_FILES_PATH_BYTES} one request to the "
            "daemon may carry; use shorter paths (e.g. a shorter directory), fewer files, or one HDF5 virtual dataset"
        )
    seen: set[str] = set()
    for p in paths:
        if len(p) > MAX_PATH_CHARS:
            raise ConfigError(f"{p[:80]}... is longer than the {MAX_PATH_CHARS} characters a path may have")
        if p in seen:
            raise ConfigError(f"{p} is named twice; each file of a multi-file dataset may appear once")
        seen.add(p)


def expand_paths(path: object) -> FileSet:
    """``path`` (one path, a glob pattern, or a list or tuple of paths) as absolute paths in
    row order. A pattern (``*``, ``?``, ``[...]``) is expanded here, with this process's rights,
    and sorted; list entries are paths taken literally. URLs (hdf5/remote.py) stay as they are;
    an ``s3://`` or ``gs://`` pattern is listed in the store (one LIST request a prefix).

    Raised when a pattern matches no file: SourceNotFound (no object: ObjectNotFound). Raised for
    an empty list, an entry that is not a path, a file named twice, or more files than one dataset
    may have: ConfigError.
    """
    if isinstance(path, (str, os.PathLike)):
        text = os.fspath(path)
        if isinstance(text, bytes) or not text:
            raise ConfigError(f"path must be a non-empty str path, a glob pattern or a list of paths, got {path!r}")
        if is_url(text):  # s3://, gs://, https:// (hdf5/remote.py)
            return _expand_url(text) if _is_pattern(text) else FileSet((_absolute(text),), "")
        if not _is_pattern(text) or os.path.lexists(text):  # a file whose name holds [ ] * ? is itself
            return FileSet((os.path.abspath(text),), "")
        matches = sorted(os.path.abspath(m) for m in glob.glob(os.path.expanduser(text)))
        if not matches:
            raise SourceNotFound(
                f"pattern {text!r} matches no file (relative patterns are expanded from {os.getcwd()}); check it"
            )
        check_file_list(matches)
        return FileSet(tuple(matches), text)
    if isinstance(path, (list, tuple)):
        if not path:
            raise ConfigError("path is an empty list: name at least one HDF5 file")
        out = []
        for item in path:
            text = os.fspath(item) if isinstance(item, (str, os.PathLike)) else None
            if not isinstance(text, str) or not text:
                raise ConfigError(f"every entry of the path list must be a str path, got {item!r}")
            out.append(_absolute(text))
        check_file_list(out)
        return FileSet(tuple(out), "")
    raise ConfigError(f"path must be a str path, a glob pattern or a list of paths, got {type(path).__name__}")


def describe_files(paths: Sequence[str], shown: str = "", limit: int = 2) -> str:
    """``'data/run_*.h5' (5 files: /d/run_0.h5 ... /d/run_4.h5)``: a file set in one line."""
    head = f"{shown!r} " if shown else ""
    if len(paths) <= limit:
        return f"{head}({len(paths)} files: {', '.join(paths)})"
    return f"{head}({len(paths)} files: {paths[0]} ... {paths[-1]})"


def _rows_of(info: DatasetInfo) -> str:
    """What a file's rows of a key are, for messages: ``rows of shape (3, 4) (uint8)``,
    ``variable-length rows of float32``, ``variable-length utf-8 strings``."""
    if info.vlen == SEQ:
        return f"variable-length rows of {info.dtype}"
    if info.vlen:
        return f"variable-length {info.vlen} strings"
    return f"rows of shape {info.row_shape} ({info.dtype})"


def set_dtype(paths: Sequence[str], infos: Sequence[DatasetInfo], requested: np.dtype | None) -> np.dtype:
    """The dtype rows of the set are held in before any requested cast: the files' common
    dtype (variable-length rows: their common base dtype), or ``requested`` when they differ
    (each file's rows are then cast to it with numpy's rules). Raised when they differ and no
    requested dtype holds every file's values: DataError naming the first file whose dtype
    differs from the first file's."""
    first = infos[0].dtype
    if all(info.dtype == first for info in infos):
        return first
    i = next(i for i, info in enumerate(infos) if info.dtype != first)
    if first.kind == "S" and infos[i].dtype.kind == "S":
        # no dtype can be requested for byte strings (source.check_cast): say what to change in the files
        raise DataError(
            f"{paths[i]}: dataset {infos[i].key!r} holds byte strings of {infos[i].dtype.itemsize} bytes, but "
            f"{paths[0]} has {first.itemsize}: the files of a multi-file dataset must hold byte strings of the same "
            f"length; rewrite the shorter ones with the longest length (e.g. h5py.string_dtype(length="
            f"{max(x.dtype.itemsize for x in infos)}))"
        )
    if requested is not None and all(np.can_cast(info.dtype, requested, "safe") for info in infos):
        return requested
    if requested is None:
        fix = f"pass a dtype every file casts to safely (e.g. {np.result_type(*(x.dtype for x in infos)).name!r})"
    else:
        j = next(j for j, info in enumerate(infos) if not np.can_cast(info.dtype, requested, "safe"))
        fix = f"the requested {requested} cannot hold every {infos[j].dtype} value of {paths[j]}"
    if infos[i].vlen:
        raise DataError(
            f"{paths[i]}: dataset {infos[i].key!r} holds {_rows_of(infos[i])}, but {paths[0]} has "
            f"{_rows_of(infos[0])}: the files of a multi-file dataset must agree on the values' dtype, or all cast "
            f"safely to the dtype requested; {fix}"
        )
    raise DataError(
        f"{paths[i]}: dataset {infos[i].key!r} has dtype {infos[i].dtype}, but {paths[0]} has {first}: the files of a "
        f"multi-file dataset must agree on dtype, or all cast safely to the dtype requested; {fix}"
    )


def check_agreement(paths: Sequence[str], infos: Sequence[DatasetInfo], requested: np.dtype | None) -> np.dtype:
    """Raised when a file's rows are of another kind (fixed, variable-length, strings) or
    shape than the first file's, or dtypes differ in a way ``set_dtype`` refuses: DataError
    naming the first file that differs; when a dtype is requested for strings:
    UnsupportedDataset (source.check_cast). Returns the set's dtype (``set_dtype``)."""
    first = infos[0]
    for path, info in zip(paths[1:], infos[1:]):
        if info.vlen != first.vlen:
            raise DataError(
                f"{path}: dataset {info.key!r} holds {_rows_of(info)}, but {paths[0]} has {_rows_of(first)}: the "
                "files of a multi-file dataset must agree on the kind of rows (fixed-shape, variable-length, strings)"
            )
        if info.row_shape != first.row_shape:
            raise DataError(
                f"{path}: dataset {info.key!r} has rows of shape {info.row_shape}, but {paths[0]} has "
                f"{first.row_shape}: the files of a multi-file dataset must agree on row shape"
            )
    check_cast(first, requested)
    return set_dtype(paths, infos, requested)


def check_file_lengths(paths: Sequence[str], keys: Sequence[str], rows: Sequence[Sequence[int]]) -> None:
    """``rows[k][i]``: rows of ``keys[k]`` in file ``i``. Raised when two keys differ in one
    file (their rows would pair up across files): LengthMismatch naming the first such file."""
    for k in range(1, len(keys)):
        for i, path in enumerate(paths):
            if rows[k][i] != rows[0][i]:
                raise LengthMismatch(
                    f"{path}: {keys[0]!r} has {rows[0][i]} rows but {keys[k]!r} has {rows[k][i]}: in a multi-file "
                    "dataset every file must hold as many rows of each key"
                )


@dataclass(frozen=True)
class Piece:
    """The rows of one file that a RowRange holds: file ``index``'s local rows ``local``
    (``range(start, stop, step)`` in that file), filling positions ``[k0, k1)`` of the shard."""

    index: int
    local: RowRange
    k0: int
    k1: int


def offsets_of(counts: Sequence[int]) -> np.ndarray:
    """``[0, n0, n0 + n1, ...]``: where each file's rows start among the global rows."""
    return np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))]).astype(np.int64)


def pieces(rows: RowRange, counts: Sequence[int], span: tuple[int, int] | None = None) -> list[Piece]:
    """``rows`` (global) cut into one Piece per file it touches, in order; ``span``: only the
    global rows ``[a, b)`` of it."""
    out: list[Piece] = []
    if not len(rows):
        return out
    first, last = span if span is not None else rows.span
    offsets = offsets_of(counts)
    start, step = rows.start, rows.step
    i = max(int(np.searchsorted(offsets, first, "right")) - 1, 0)
    while i < len(counts) and offsets[i] < last:
        lo, hi = max(int(offsets[i]), first), min(int(offsets[i + 1]), last)
        k0 = max(-(-(lo - start) // step), 0)
        k1 = min(max(-(-(hi - start) // step), 0), len(rows))
        if k1 > k0:
            g0 = start + k0 * step
            out.append(Piece(i, RowRange.of(g0 - int(offsets[i]), k1 - k0, step), k0, k1))
        i += 1
    return out


def plan_file_parts(rows: RowRange, counts: Sequence[int], row_bytes: int, processes: int,
                    min_part_bytes: int) -> list[tuple[int, int]]:
    """Global row spans, cut at file boundaries, for the processes of one load: at most
    ``processes``, each at least ``min_part_bytes`` of rows or MIN_PART_FILES files, of about
    equal bytes. One span: no split."""
    parts = pieces(rows, counts)
    first, last = rows.span
    if len(parts) < 2 or processes <= 1:
        return [(first, last)]
    work = len(rows) * row_bytes
    wanted = min(processes, len(parts), max(1, work // max(min_part_bytes, 1), len(parts) // MIN_PART_FILES))
    if wanted <= 1:
        return [(first, last)]
    offsets = offsets_of(counts)
    sizes = np.array([p.k1 - p.k0 for p in parts], dtype=np.float64)
    ends = np.cumsum(sizes) / sizes.sum()  # fraction of the rows done after each piece
    cuts = [int(np.searchsorted(ends, j / wanted, "left")) for j in range(1, wanted)]
    edges = [first] + [int(offsets[parts[c].index + 1]) for c in sorted(set(cuts)) if c < len(parts) - 1] + [last]
    edges = sorted(set(edges))
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]
