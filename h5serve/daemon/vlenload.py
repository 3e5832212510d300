"""Loading variable-length rows into a segment (the loader's path for a ``vlen`` segment).

The rows are read a block of rows at a time (one h5py call per block: HDF5 converts
variable-length data element by element whatever the selection, so bigger blocks only save
call overhead) and flattened into Arrow's layout (h5serve/vlen.py): the values are appended
to the segment as they come, the offsets are kept here (8 bytes a row) and written once at
the end, in front of the values.

The values' total size is known only once every row is read. Each block's bytes are
reserved with ``posix_fallocate`` before they are written (``SegmentWriter.reserve``), so a
full /dev/shm is a ShmFull naming the bytes, never a SIGBUS, and the segment grows to its
exact size. Nothing here writes through a mapping; the header's metadata gets the number of
values at the end (``SegmentWriter.set_values``), before the loader publishes.

One process (``--load-processes`` does not split a vlen load yet): where a part's values go
depends on the lengths of every row before it, so parts would need a barrier (each part
reads its rows into memory and publishes their lengths, the loader sums them and reserves the
values, then each part writes at its offset), holding the shard's values in private memory
meanwhile. The cost is HDF5's conversion, a few microseconds a row.
"""

from __future__ import annotations

from typing import Callable

import h5py
import numpy as np

from ..compound import rows_dataset
from ..errors import SourceChanged
from ..rawcopy import write_all
from ..crc import LOAD_CRC
from ..segments import SegmentMeta, SegmentWriter
from ..source import inspect_dataset
from ..vlen import read_vlen, values_offset

__all__ = ["load_vlen", "BLOCK_VALUE_BYTES"]

BLOCK_VALUE_BYTES = 4 * 1024 * 1024  # about this many bytes of values are read per h5py call
_FIRST_BLOCK_ROWS = 4096  # when the mean row length is not known yet
_MAX_BLOCK_ROWS = 1 << 20


def _block_rows(value_bytes: float) -> int:
    """Rows per read for rows of ``value_bytes`` bytes on average."""
    if value_bytes <= 0:
        return _FIRST_BLOCK_ROWS
    return int(min(max(BLOCK_VALUE_BYTES // value_bytes, 64), _MAX_BLOCK_ROWS))


def load_vlen(f: h5py.File, meta: SegmentMeta, writer: SegmentWriter, progress: Callable[[int], None],
              checksum: bool) -> tuple[int, int]:
    """Read the shard ``meta`` describes out of ``f`` into ``writer``'s segment (created for
    no values yet): offsets, then values. Returns ``(crc32 of the data area or -1, values)``.

    Raised when the dataset is no longer what the request saw: SourceChanged. Raised when rows
    cannot be read: DataError; when /dev/shm is full: ShmFull.
    """
    info = inspect_dataset(f, meta.key, vlen=True)
    if (info.vlen, info.dtype.str, info.rows) != (meta.vlen, meta.source_dtype, meta.total_rows):
        raise SourceChanged(f"{meta.source_path}[{meta.key}] is not the dataset the request saw; request it again")
    stored = meta.np_dtype
    rows = meta.row_range
    dset = rows_dataset(f, meta.key)
    fd, data_at = writer.data_target()
    first_value = values_offset(meta.rows)
    offsets = np.zeros(first_value // 8, dtype=np.int64)  # the whole offsets region, padding included
    count = 0  # values written
    crc = 0
    block = _block_rows(info.mean_length * stored.itemsize)
    k = 0
    while k < meta.rows:
        n = min(block, meta.rows - k)
        a = rows.start + k * rows.step
        b = a + (n - 1) * rows.step + 1
        lengths, values = read_vlen(dset, meta.key, meta.vlen, info.dtype, slice(a, b, rows.step), a, b)
        values = np.ascontiguousarray(values.astype(stored, copy=False))
        np.cumsum(lengths, out=offsets[k + 1:k + 1 + n])
        offsets[k + 1:k + 1 + n] += offsets[k]
        if values.size:
            at = first_value + count * stored.itemsize
            writer.reserve(at, values.nbytes)
            raw = memoryview(values.view(np.uint8))
            write_all(fd, raw, data_at + at)
            if checksum:
                crc = LOAD_CRC.update(raw, crc)
        count += values.size
        k += n
        progress(k)
        if n == block and k < meta.rows:  # aim the next block at BLOCK_VALUE_BYTES
            block = _block_rows(values.nbytes / n)
    write_all(fd, memoryview(offsets.view(np.uint8)), data_at)
    writer.set_values(count)
    if not checksum:
        return -1, count
    return LOAD_CRC.combine(LOAD_CRC.update(offsets, 0), crc, count * stored.itemsize), count
