"""Variable-length rows: numeric sequences (``h5py.vlen_dtype(np.float32)``) and variable-length
strings, in Arrow's layout.

A shard of ``n`` variable-length rows is two arrays: ``offsets`` (int64, ``n + 1`` of them,
``offsets[0] == 0``) and ``values`` (every row's values one after the other, in the base
dtype; strings as their encoded bytes, ``uint8``). Row ``i`` is
``values[offsets[i]:offsets[i + 1]]``. A segment holds both in its data area, offsets first
(padded to ``VALUES_ALIGN`` bytes), then values (h5serve/segments/format.py).

Shared by the daemon's loader, the client's lazy and memory backends and its gather (the
client never imports ``h5serve.daemon``):

- ``vlen_kind``: what a dtype is (``""`` fixed rows, ``SEQ`` numeric sequences, else the
  encoding of variable-length strings) and why it cannot be served;
- ``read_vlen``: rows of HDF5 read in one h5py call (HDF5 reads variable-length data element
  by element, whatever the selection), flattened into lengths and values;
- ``gather``: a batch of rows out of offsets and values with one vectorised ``take``, no
  Python per row.
"""

from __future__ import annotations

from typing import Any

import h5py
import numpy as np

from ..errors import DataError

__all__ = ["SEQ", "VLEN_KINDS", "vlen_kind", "is_text", "read_vlen",
           "flatten", "offsets_of", "gather", "estimate_mean_length", "ESTIMATE_ROWS"]

SEQ = "seq"  # the vlen kind of numeric sequences; strings' kind is their encoding ("utf-8", "ascii")
VLEN_KINDS = frozenset({"", SEQ, "utf-8", "ascii"})  # "": fixed rows
LONG_ROWS = 512  # mean values per row above which a batch is gathered a row at a time (gather)
ESTIMATE_ROWS = 1024  # rows read to estimate a dataset's mean row length (the daemon's budget check)
_NUMERIC = "biufc"


def vlen_kind(dtype: np.dtype) -> tuple[str, np.dtype | None, str]:
    """``(kind, base, reason)`` of a dataset's dtype: kind ``""`` for fixed-size rows (base
    None), ``SEQ`` for numeric sequences (base: their dtype, native order), or the encoding of
    variable-length strings (base ``uint8``: the bytes). ``reason`` is non-empty (a few words)
    when it is variable-length but cannot be served: sequences of compound types, of
    references, of sequences, of arrays, of strings."""
    string = h5py.check_string_dtype(dtype)
    if string is not None:
        if string.length is not None:
            return "", None, ""
        return string.encoding, np.dtype(np.uint8), ""
    base = h5py.check_vlen_dtype(dtype)
    if base is None:
        return "", None, ""
    base = np.dtype(base) if not isinstance(base, np.dtype) else base
    if base.kind == "O" or h5py.check_vlen_dtype(base) is not None or h5py.check_string_dtype(base) is not None:
        inner = h5py.check_ref_dtype(base)
        what = "object references" if inner is not None else "variable-length data"
        return SEQ, None, f"variable-length sequences of {what}"
    if base.fields is not None:
        return SEQ, None, "variable-length sequences of a compound type"
    if base.subdtype is not None:
        return SEQ, None, "variable-length sequences of an array type"
    if base.kind not in _NUMERIC:
        return SEQ, None, f"variable-length sequences of {base} (not numeric)"
    if base.kind in "fc" and base.itemsize > (8 if base.kind == "f" else 16):
        return SEQ, None, f"variable-length sequences of {base} (extended precision, which torch cannot hold)"
    return SEQ, base.newbyteorder("="), ""


def is_text(kind: str) -> bool:
    """Whether a vlen ``kind`` is strings (their encoding) rather than numeric sequences."""
    return bool(kind) and kind != SEQ


def _objects(dset: Any, selection: Any) -> np.ndarray:
    """h5py's read of ``selection`` of a vlen dataset, or of a vlen field of a compound one
    (compound.FieldRows: HDF5 reads that member only)."""
    field = getattr(dset, "field", "")
    if field:
        return dset.dset.fields(field)[selection]
    return dset[selection]


def read_vlen(dset: Any, key: str, kind: str, base: np.dtype, selection: Any, first: int = 0,
              last: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths, values)`` of the rows ``selection`` (a slice, or increasing row numbers)
    of ``dset``, read in one h5py call. ``first``/``last`` name the rows for messages.

    Raised when HDF5 cannot read them: DataError, naming the rows.
    """
    try:
        objects = _objects(dset, selection)
    except (OSError, RuntimeError) as exc:
        raise DataError(
            f"cannot read rows {first}..{max(last - 1, first)} of dataset {key!r} in {dset.file.filename}: {exc}; "
            "the file may be damaged or truncated (check it with `h5dump -H` / `h5ls -rv`, or rewrite it)"
        ) from exc
    return flatten(objects, kind, base)


def flatten(objects: np.ndarray, kind: str, base: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """h5py's object array of rows (arrays, or ``bytes`` for strings) as ``(lengths, values)``:
    the values exactly as h5py returned them, one after the other, in ``base``."""
    rows = objects.tolist()
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    if is_text(kind):
        blob = b"".join(r if isinstance(r, bytes) else r.encode(kind) for r in rows)
        return lengths, np.frombuffer(blob, dtype=np.uint8)
    if not rows or not lengths.any():
        return lengths, np.empty(0, dtype=base)
    return lengths, np.concatenate(rows).astype(base, copy=False)


def offsets_of(lengths: np.ndarray) -> np.ndarray:
    """Arrow offsets (int64, ``len(lengths) + 1``, starting at 0) of rows of ``lengths``."""
    offsets = np.empty(len(lengths) + 1, dtype=np.int64)
    offsets[0] = 0
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def gather(offsets: np.ndarray, values: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(flat, lengths)`` of the rows at ``positions`` (valid, non-negative), in that order:
    their values copied into one fresh array (``values`` is only read: it may be a read-only
    mapping) by one ``take`` over an index built without Python per row (rows of more than
    LONG_ROWS values on average: a slice copy per row)."""
    starts = offsets.take(positions)
    lengths = offsets.take(positions + 1) - starts
    total = int(lengths.sum())
    if total == 0:
        return np.empty(0, dtype=values.dtype), lengths
    if len(positions) == 1:
        a = int(starts[0])
        return values[a:a + total].copy(), lengths
    if total > LONG_ROWS * len(positions):
        # long rows: an index of every value costs more than a slice copy per row (measured:
        # mean 4096 values, 17 ms vs 1 ms a batch of 256; equal near 512)
        out = np.empty(total, dtype=values.dtype)
        at = 0
        for a, n in zip(starts.tolist(), lengths.tolist()):
            out[at:at + n] = values[a:a + n]
            at += n
        return out, lengths
    # index of value j of row k: starts[k] + j = (starts[k] - row k's start in flat) + flat position
    shift = starts - (np.cumsum(lengths) - lengths)
    index = np.repeat(shift, lengths)
    index += np.arange(total, dtype=np.int64)
    return values.take(index), lengths


def estimate_mean_length(dset: Any, kind: str, base: np.dtype, rows: int) -> float:
    """The mean length of the first ESTIMATE_ROWS rows (0.0 when there are none): what the
    daemon reserves its budget by before a load knows the real size. Never raises (an
    estimate; the load itself reports unreadable rows)."""
    n = min(rows, ESTIMATE_ROWS)
    if n == 0:
        return 0.0
    try:
        lengths, _ = flatten(_objects(dset, slice(0, n)), kind, base)
    except Exception:  # noqa: BLE001 - only an estimate
        return 0.0
    return float(lengths.mean())
