"""Loading variable-length rows into a segment (the loader's path for a ``vlen`` segment).

The rows are read a block of rows at a time (one h5py call per block: HDF5 converts
variable-length data element by element whatever the selection, so bigger blocks only save
call overhead) and flattened into Arrow's layout (h5serve/hdf5/vlen.py): the values are appended
to the segment as they come, the offsets are kept here (8 bytes a row) and written once at
the end, in front of the values.

The values' total size is known only once every row is read. Each block's bytes are
reserved with ``posix_fallocate`` before they are written (``SegmentWriter.reserve``), so a
full /dev/shm is a ShmFull naming the bytes, never a SIGBUS, and the segment grows to its
exact size. Nothing here writes through a mapping; the header's metadata gets the number of
values at the end (``SegmentWriter.set_values``), before the loader publishes.

The budget: the store counted the load by an estimate (the mean length of the first rows),
which a file can make as small as it likes (empty first rows, long last ones). So the store
gives the loader a ``Room``, the bytes its segment may take in tmpfs (whole pages), counted
against the budget while the load runs; before a block's values are reserved the segment's
pages with them are checked against it, and past it the load stops with BudgetExceeded
naming the file, the key and the budget (the loader removes the temporary). Rows still to
come are never read into the segment, so it never holds more than its room.

Many files as one dataset: each file's rows of the shard are read in turn (each file opened
and checked to be the one resolved, as daemon/loading/fileset.py does for fixed rows) into the same
values and offsets, offsets running on across files: the segment is what one file holding
every file's rows one after the other would give.

One process (``--load-processes`` does not split a vlen load yet): where a part's values go
depends on the lengths of every row before it, so parts would need a barrier (each part
reads its rows into memory and publishes their lengths, the loader sums them and reserves the
values, then each part writes at its offset), holding the shard's values in private memory
meanwhile. The cost is HDF5's conversion, a few microseconds a row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

from ...errors import BudgetExceeded, SourceChanged
from ...hdf5.files import pieces
from ...hdf5.identity import open_h5_verified, pinned_rows
from ...hdf5.rawcopy import write_all
from ...hdf5.source import DatasetInfo, inspect_dataset
from ...hdf5.vlen import read_vlen
from ...order.sharding import RowRange
from ...segments import SegmentMeta, SegmentWriter, values_offset
from ...util.crc import LOAD_CRC
from ...util.units import allocated_bytes
from ..store.refusals import over_room

__all__ = ["load_vlen", "BLOCK_VALUE_BYTES", "Room"]

BLOCK_VALUE_BYTES = 4 * 1024 * 1024  # about this many bytes of values are read per h5py call
_FIRST_BLOCK_ROWS = 4096  # when the mean row length is not known yet
_MAX_BLOCK_ROWS = 1 << 20


@dataclass(frozen=True)
class Room:
    """``limit``: the bytes a variable-length load's segment may take in tmpfs (whole pages,
    header and offsets included), what the store counts for it against ``budget`` (set by
    ``rule``) until the load is done."""

    limit: int
    budget: int
    rule: str = "--max-memory"

    def check(self, meta: SegmentMeta, file_size: int) -> None:
        """Raised when a segment of ``file_size`` bytes would take more than the room:
        BudgetExceeded, naming ``meta``'s file and key, the room and the budget."""
        if allocated_bytes(file_size) > self.limit:
            raise BudgetExceeded(over_room(meta, allocated_bytes(file_size), self.limit, self.budget, self.rule))


def _block_rows(value_bytes: float) -> int:
    """Rows per read for rows of ``value_bytes`` bytes on average."""
    if value_bytes <= 0:
        return _FIRST_BLOCK_ROWS
    return int(min(max(BLOCK_VALUE_BYTES // value_bytes, 64), _MAX_BLOCK_ROWS))


def _blocks(dset: Any, info: DatasetInfo, key: str, rows: RowRange, base: np.dtype,
            block: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(lengths, values)`` of ``rows`` of ``dset``, a block of rows (one h5py call) at a time,
    the values in ``base``; the block aims at BLOCK_VALUE_BYTES once row lengths are seen."""
    k = 0
    while k < len(rows):
        n = min(block, len(rows) - k)
        a = rows.start + k * rows.step
        b = a + (n - 1) * rows.step + 1
        lengths, values = read_vlen(dset, key, info.vlen, info.dtype, slice(a, b, rows.step), a, b)
        yield lengths, np.ascontiguousarray(values.astype(base, copy=False))
        k += n
        if n == block and k < len(rows):
            block = _block_rows(values.nbytes / n)


def _sources(f: h5py.File, meta: SegmentMeta, stored: np.dtype,
             virtual_ok: bool) -> Iterator[tuple[Any, DatasetInfo, RowRange]]:
    """Each file's dataset, its description and its rows of the shard, in row order: ``f``
    alone, or each file of a multi-file set opened in turn (checked to be the one resolved);
    the file holding the rows (an external link's target) checked to be one the daemon checked.

    Raised when a file is no longer what the request saw: SourceChanged.
    """
    if not meta.files:
        info = inspect_dataset(f, meta.key, vlen=True)
        if (info.vlen, info.dtype.str, info.rows) != (meta.vlen, meta.source_dtype, meta.total_rows):
            raise SourceChanged(f"{meta.source_path}[{meta.key}] is not the dataset the request saw; request it again")
        # HDF5 follows an external link by path: the file it opened must be the one checked
        dset = pinned_rows(f, meta.key, (meta.linked,) if meta.linked else (meta.source,),
                           f"{meta.source_path}[{meta.key}]", virtual_ok=virtual_ok)
        yield dset, info, meta.row_range
        return
    set_dtype = np.dtype(meta.source_dtype)
    for piece in pieces(meta.row_range, meta.file_rows):
        entry = meta.files[piece.index]
        with open_h5_verified(entry) as g:
            info = inspect_dataset(g, meta.key, vlen=True)
            if info.vlen != meta.vlen or info.rows != entry[5] or not np.can_cast(info.dtype, set_dtype, "safe"):
                raise SourceChanged(f"{entry[0]}[{meta.key}] is not the dataset the request saw (it changed while "
                                    "being loaded); request it again")
            dset = pinned_rows(g, meta.key, (entry, *meta.depends), f"{entry[0]}[{meta.key}]", virtual_ok=virtual_ok)
            yield dset, info, piece.local


def load_vlen(f: h5py.File, meta: SegmentMeta, writer: SegmentWriter, progress: Callable[[int], None],
              checksum: bool, room: Room | None = None, *, virtual_ok: bool) -> tuple[int, int]:
    """Read the shard ``meta`` describes out of ``f`` (many files: out of each file of
    ``meta.files`` in turn, their rows one after the other) into ``writer``'s segment (created
    for no values yet): offsets, then values, never past ``room`` (None: no limit). Returns
    ``(the LOAD_CRC of the data area or -1, values)``.

    Raised when a dataset is no longer what the request saw: SourceChanged. Raised when rows
    cannot be read: DataError; when /dev/shm is full: ShmFull; when the values outgrow
    ``room``: BudgetExceeded.
    """
    stored = meta.np_dtype
    fd, data_at = writer.data_target()
    first_value = values_offset(meta.rows)
    offsets = np.zeros(first_value // 8, dtype=np.int64)  # the whole offsets region, padding included
    count = 0  # values written
    crc = 0
    k = 0  # rows done
    for dset, info, rows in _sources(f, meta, stored, virtual_ok):
        first_block = _block_rows(info.mean_length * stored.itemsize)
        for lengths, values in _blocks(dset, info, meta.key, rows, stored, first_block):
            n = len(lengths)
            np.cumsum(lengths, out=offsets[k + 1:k + 1 + n])
            offsets[k + 1:k + 1 + n] += offsets[k]  # shifted past every earlier row, of this file and those before
            if values.size:
                at = first_value + count * stored.itemsize
                if room is not None:  # before a byte of it is reserved: the segment never takes more
                    room.check(meta, data_at + at + values.nbytes)
                writer.reserve(at, values.nbytes)
                raw = values.view(np.uint8).data
                write_all(fd, raw, data_at + at)
                if checksum:
                    crc = LOAD_CRC.update(raw, crc)
            count += values.size
            k += n
            progress(k)
    if k != meta.rows:
        raise SourceChanged(f"{meta.source_path}[{meta.key}]: {k} rows read where {meta.rows} were expected; "
                            "request it again")
    write_all(fd, offsets.view(np.uint8).data, data_at)
    writer.set_values(count)
    if not checksum:
        return -1, count
    return LOAD_CRC.combine(LOAD_CRC.update(offsets, 0), crc, count * stored.itemsize), count
