"""One description of a dataset read through h5py: its files, keys, every file's DatasetInfo
of every key (rows, row shape, dtype, chunking, variable-length kind), the dtype the files
hold together and the dtype rows are returned in, each file's rows and the total.

``describe`` opens each file once, inspects every key and makes every check the lazy,
in-memory and stream readers relied on (the files agree: files.check_agreement; the keys
have the same rows, and, over many files, the same rows in each file: ``check_rows``; a
requested cast is allowed: source.check_cast), so a reader given a DatasetDescription only
reads. The shm backend, which reads none of it (the daemon does), checks the rows the
daemon's segments hold with the same ``check_rows``.

Torch-free and daemon-free; the daemon keeps its own verified reads (daemon/access/resolver.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .files import check_agreement, check_file_lengths
from .identity import open_h5, open_remote_h5
from .remote import METADATA_BLOCK_BYTES, METADATA_CACHE_BLOCKS, RemoteIdentity, is_url
from .source import DatasetInfo, check_row_counts, inspect_dataset

__all__ = ["KeyDescription", "DatasetDescription", "describe", "check_rows"]


@dataclass(frozen=True)
class KeyDescription:
    """One key across the files: each file's DatasetInfo (row order) and the dtypes."""

    key: str
    infos: tuple[DatasetInfo, ...]  # one per file, in row order
    dtype: np.dtype  # what the files hold together, before a requested cast (files.set_dtype)
    out_dtype: np.dtype  # what rows are returned in: the requested dtype, else ``dtype``

    @property
    def first(self) -> DatasetInfo:
        return self.infos[0]

    @property
    def vlen(self) -> str:
        """"" for fixed-size rows, else the variable-length kind (the files agree on it)."""
        return self.infos[0].vlen

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.infos[0].row_shape

    @property
    def file_rows(self) -> tuple[int, ...]:
        return tuple(info.rows for info in self.infos)


@dataclass(frozen=True)
class DatasetDescription:
    """A dataset as ``describe`` found it, checked (see the module docstring)."""

    files: tuple[str, ...]  # absolute, in row order (one file: that file)
    pattern: str  # the glob pattern they were expanded from ("" for a list or one file)
    keys: tuple[KeyDescription, ...]  # in the order asked
    # one per file: a remote file's identity when it was described (hdf5/remote.py), None for a local one; every
    # later open of it is checked against it (SourceChanged), so no process reads a rewritten object
    remote: tuple[RemoteIdentity | None, ...] = ()

    def pin(self, index: int) -> RemoteIdentity | None:
        """File ``index``'s identity as described, when it is remote (else None)."""
        return self.remote[index] if self.remote else None

    @property
    def total_rows(self) -> int:
        return sum(self.keys[0].file_rows)

    @property
    def file_rows(self) -> tuple[int, ...]:
        """Each file's rows (every key has as many in each file)."""
        return self.keys[0].file_rows

    @property
    def infos(self) -> list[DatasetInfo]:
        """The first file's DatasetInfo of every key (one file: the file's)."""
        return [k.first for k in self.keys]

    @property
    def out_dtypes(self) -> list[np.dtype]:
        return [k.out_dtype for k in self.keys]

    @property
    def vlen_kinds(self) -> list[str]:
        return [k.vlen for k in self.keys]


def check_rows(keys: Sequence[str], totals: Sequence[int], files: Sequence[str] = (),
               file_rows: Sequence[Sequence[int]] = ()) -> None:
    """``totals[k]``: rows of ``keys[k]``; ``file_rows[k][i]``: its rows in ``files[i]`` (many
    files only). Raised when the keys differ in length (naming each key's), or in one file
    (their rows would pair up across files; naming the first such file): LengthMismatch."""
    check_row_counts(tuple(keys), list(totals))
    if len(files) > 1:
        check_file_lengths(files, keys, file_rows)


def describe(files: Sequence[str], keys: Sequence[str], dtypes: Sequence[np.dtype | None], *, pattern: str = "",
             vlen: bool = True) -> DatasetDescription:
    """``keys`` of ``files`` (absolute, in row order; files.expand_paths), each file opened once
    and closed, with ``dtypes`` the dtype requested for each key (None: the source's).
    ``vlen``: variable-length rows are described (else refused, as source.inspect_dataset does).

    Raised when a file or key is missing or cannot be served: the DataError naming that file
    (source.inspect_dataset). Raised when the files disagree on a key's kind, row shape or
    dtype: DataError (files.check_agreement). Raised when the keys differ in length: LengthMismatch
    (``check_rows``). Raised when a dtype is requested for strings: UnsupportedDataset.
    """
    per_file: list[list[DatasetInfo]] = []
    remote: list[RemoteIdentity | None] = []
    for path in files:
        if is_url(path):
            f, identity = open_remote_h5(path, block_bytes=METADATA_BLOCK_BYTES, cache_blocks=METADATA_CACHE_BLOCKS)
            remote.append(identity)
        else:
            f = open_h5(path)
            remote.append(None)
        with f:  # metadata only; closed before any fork
            per_file.append([inspect_dataset(f, key, vlen=vlen) for key in keys])
    infos = [tuple(row[k] for row in per_file) for k in range(len(keys))]
    counts = [[info.rows for info in key_infos] for key_infos in infos]
    if len(files) > 1:  # a file of another kind or shape is named as such before rows are compared
        set_dtypes = [check_agreement(files, key_infos, requested) for key_infos, requested in zip(infos, dtypes)]
        check_rows(keys, [sum(c) for c in counts], files, counts)
    else:
        check_rows(keys, [sum(c) for c in counts])
        set_dtypes = [check_agreement(files, key_infos, requested) for key_infos, requested in zip(infos, dtypes)]
    described = tuple(KeyDescription(key, key_infos, dtype, requested or dtype)
                      for key, key_infos, dtype, requested in zip(keys, infos, set_dtypes, dtypes))
    return DatasetDescription(tuple(files), pattern, described, tuple(remote) if any(remote) else ())
