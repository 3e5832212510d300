"""HDF5 datasets through h5py: what a key names (``DatasetInfo``: rows, row shape, dtype,
chunking) and whether h5serve can serve it, and the dtype rules (reading rows is in reads.py).

Shared by the daemon's loader, the lazy client backend and the in-memory compat backend, so
the three read the same rows the same way and cast with the same numpy rule (never HDF5's own
conversion, which can differ from numpy's for out-of-range values).

h5py errors are translated to h5serve errors here and in the modules this one uses: which file
a path names (identity.py), links on a key's path (links.py), filters and storage (filters.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import h5py
import numpy as np

from ..errors import ConfigError, KeyNotFound, LengthMismatch, UnsupportedDataset
from .compound import FieldRows, split_field
from .filters import check_filters, check_storage
from .links import follow
from .vds import virtual_sources
from .vlen import estimate_mean_length, is_text, vlen_kind

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

__all__ = [
    "DatasetInfo",
    "inspect_dataset",
    "check_row_counts",
    "check_cast",
    "resolve_dtype",
    "storage_dtype",
    "SOURCE_KINDS",
]

SERVABLE_KINDS = "biufc"  # what a requested dtype may be
SOURCE_KINDS = SERVABLE_KINDS + "S"  # what a dataset may hold: also fixed-length byte strings


@dataclass(frozen=True)
class DatasetInfo:
    key: str
    rows: int
    row_shape: tuple[int, ...]
    dtype: np.dtype  # native byte order
    chunk_rows: int  # rows per chunk along axis 0 (the whole dataset if not chunked)
    linked_file: str = ""  # realpath of the file holding the data when reached by an external link
    chunked: bool = True  # False: contiguous or compact layout (any row range reads directly)
    field: str = ""  # a field of a compound dataset: ``key`` is "<dataset>:<field>" (compound.py)
    virtual_sources: tuple[str, ...] = ()  # realpaths of the other files a virtual dataset maps (vds.py)
    # variable-length rows (h5serve/hdf5/vlen.py): "" fixed rows, "seq" numeric sequences of ``dtype``,
    # else strings in that encoding (``dtype`` uint8: their bytes); row_shape is then ()
    vlen: str = ""
    mean_length: float = 0.0  # vlen: mean length of the first rows (an estimate, for budgets)

    @property
    def is_bytes(self) -> bool:
        """Fixed-length byte strings (served as lists of ``bytes``, not tensors)."""
        return self.dtype.kind == "S" and not self.vlen

    @property
    def is_text(self) -> bool:
        """Variable-length strings (served as lists of ``str``)."""
        return is_text(self.vlen)


def resolve_dtype(dtype: DTypeLike | None, what: str) -> np.dtype | None:
    """A requested dtype as a servable numpy dtype (native order), or None.

    Raised when numpy cannot parse it, or it is an array, structured, non-numeric or
    extended-precision dtype: ConfigError.
    """
    if dtype is None:
        return None
    try:
        resolved = np.dtype(dtype)
    except Exception as exc:  # numpy's parser raises TypeError, ValueError, SyntaxError, ...
        raise ConfigError(f"{what}={dtype!r:.80} is not a numpy dtype; use e.g. 'float32' or np.float32") from exc
    if resolved.subdtype is not None or resolved.fields is not None:
        raise ConfigError(f"{what}={dtype!r:.80} is an array or structured dtype; use a scalar numeric dtype "
                          "such as 'float32' (a row's shape comes from the dataset)")
    if resolved.kind not in SERVABLE_KINDS:
        raise ConfigError(f"{what}={resolved} is not a numeric dtype; use a bool, integer or float dtype")
    if resolved.kind in "fc" and resolved.itemsize > (8 if resolved.kind == "f" else 16):
        raise ConfigError(f"{what}={resolved} is extended precision, which torch cannot hold; use float64 or "
                          "complex128 at most")
    return resolved.newbyteorder("=")


def inspect_dataset(f: h5py.File, key: str, vlen: bool = False) -> DatasetInfo:
    """Shape, dtype and chunking of ``f[key]``. Variable-length rows (numeric sequences,
    strings) only with ``vlen`` (readers that know h5serve/hdf5/vlen.py); otherwise refused.

    Raised when the key is missing (the message lists datasets that exist), is not a
    dataset, or a soft or external link on its path is dangling (the message names the
    link and its target): KeyNotFound.
    Raised when it has no rows dimension, a dtype that is not plain numeric, a filter that
    is not available, or data in files whose changes h5serve cannot track (raw external
    storage, external links through more than one other file, virtual sources it cannot
    follow: vds.py): UnsupportedDataset. Also for variable-length rows of a base type that
    cannot be served (compound, references, nested sequences) or in more than one dimension.
    Raised when a virtual dataset's source file is missing: SourceNotFound.
    """
    dataset_key, field = split_field(f, key)
    obj, linked = follow(f, dataset_key)
    if not isinstance(obj, h5py.Dataset):
        what = "a group" if isinstance(obj, h5py.Group) else f"a {type(obj).__name__}"
        raise KeyNotFound(f"key {key!r} in {f.filename} is {what}, not a dataset; pass a dataset path like '{key}/...'")
    if obj.shape is None or len(obj.shape) == 0:
        raise UnsupportedDataset(f"dataset {key!r} in {f.filename} is scalar: it has no rows dimension to shard")
    dtype, field_shape = _field_dtype(obj, key, dataset_key, field) if field else (obj.dtype, ())
    kind, base, why = vlen_kind(dtype)
    if kind and vlen:
        return _inspect_vlen(f, obj, key, field, kind, base, why, len(obj.shape) + len(field_shape), linked)
    reason = _unservable(dtype)
    if reason:
        fields = _numeric_fields(dtype) if dtype.fields is not None else []
        hint = (f"; select one of its fields as the key, e.g. '{key}:{fields[0]}' (fields: {', '.join(fields)})"
                if fields else "")
        if kind and not why:
            hint = ("; SharedH5Dataset serves variable-length rows, this reader (H5LazyDataset, the compat preload) "
                    "does not")
        raise UnsupportedDataset(
            f"dataset {key!r} in {f.filename} has dtype {dtype} ({reason}): only bool, integer, float, complex "
            f"and fixed-length byte string data is served{hint}"
        )
    check_filters(obj, key)
    check_storage(obj, key)
    sources = virtual_sources(obj, key) if obj.is_virtual else ()
    chunks = obj.chunks
    return DatasetInfo(
        key=key,
        rows=int(obj.shape[0]),
        row_shape=tuple(int(n) for n in (*obj.shape[1:], *field_shape)),
        dtype=dtype.newbyteorder("="),  # h5py's string metadata stays: HDF5 needs it to convert UTF-8
        chunk_rows=int(chunks[0]) if chunks else max(int(obj.shape[0]), 1),
        linked_file=linked,
        chunked=bool(chunks),
        field=field,
        virtual_sources=sources,
    )


def _inspect_vlen(f: h5py.File, obj: h5py.Dataset, key: str, field: str, kind: str, base: np.dtype | None,
                  why: str, ndim: int, linked: str) -> DatasetInfo:
    """The DatasetInfo of variable-length rows (``inspect_dataset`` with ``vlen``).

    Raised when their base type cannot be served, or they have more than one dimension:
    UnsupportedDataset.
    """
    if why or base is None:
        raise UnsupportedDataset(
            f"dataset {key!r} in {f.filename} holds {why}: only variable-length sequences of bool, integer, "
            "float and complex values, and variable-length strings, are served"
        )
    if ndim != 1:
        raise UnsupportedDataset(
            f"dataset {key!r} in {f.filename} holds variable-length rows in {ndim} dimensions: only one-dimensional "
            "variable-length datasets (one sequence or string per row) are served"
        )
    check_filters(obj, key)
    check_storage(obj, key)
    rows = int(obj.shape[0])
    chunks = obj.chunks
    reader = FieldRows(obj, field) if field else obj
    return DatasetInfo(
        key=key, rows=rows, row_shape=(), dtype=base, chunk_rows=int(chunks[0]) if chunks else max(rows, 1),
        linked_file=linked, chunked=bool(chunks), field=field, vlen=kind,
        mean_length=estimate_mean_length(reader, kind, base, rows),
    )


def _numeric_fields(dtype: np.dtype) -> list[str]:
    """The fields of a compound dtype that can be served, in order."""
    if dtype.fields is None:
        return []
    return [name for name in dtype.names or () if not _unservable(dtype.fields[name][0].base)]


def _field_dtype(obj: h5py.Dataset, key: str, dataset_key: str, field: str) -> tuple[np.dtype, tuple[int, ...]]:
    """The base dtype and shape of ``field`` of the compound dataset ``obj``.

    Raised when ``obj`` is not compound, or has no such field: KeyNotFound.
    """
    names = obj.dtype.names
    if names is None:
        raise KeyNotFound(
            f"key {key!r}: dataset {dataset_key!r} in {obj.file.filename} has dtype {obj.dtype}, not a compound "
            f"type with fields; pass {dataset_key!r} itself (a key is '<dataset>:<field>' only for compound datasets)"
        )
    if field not in names:
        raise KeyNotFound(
            f"key {key!r}: compound dataset {dataset_key!r} in {obj.file.filename} has no field {field!r}; its "
            f"fields: {', '.join(names)}"
        )
    sub = obj.dtype.fields[field][0]
    return sub.base, tuple(int(n) for n in sub.shape)


def _unservable(dtype: np.dtype) -> str:
    """Why rows of ``dtype`` cannot be served (a few words), or "" when they can."""
    string = h5py.check_string_dtype(dtype)
    if string is not None:
        return "variable length strings" if string.length is None else ""
    if h5py.check_vlen_dtype(dtype) is not None:
        return "variable length sequences"
    if h5py.check_ref_dtype(dtype) is not None:
        return "object references"
    if dtype.fields is not None:
        return "a compound type"
    if dtype.subdtype is not None:
        return "an array type"
    if dtype.kind in "fc" and dtype.itemsize > (8 if dtype.kind == "f" else 16):
        return "extended precision, which torch cannot hold"
    if dtype.kind not in SOURCE_KINDS:
        return {"M": "datetimes", "m": "timedeltas", "V": "opaque bytes"}.get(dtype.kind, "not numeric")
    return ""


def check_row_counts(keys: list[str] | tuple[str, ...], rows: list[int]) -> None:
    """Raised when ``rows`` (of ``keys``, in order) are not all equal: LengthMismatch, naming
    each key's length."""
    if len(set(rows)) > 1:
        each = ", ".join(f"{key!r} has {n} rows" for key, n in zip(keys, rows))
        raise LengthMismatch(f"the keys differ in length: {each}; every key of a dataset must have the same "
                             "number of rows (one row per sample)")


def check_cast(info: DatasetInfo, requested: np.dtype | None) -> np.dtype:
    """The dtype ``info``'s rows are returned in: ``requested``, else the source dtype.

    Raised when a dtype is requested for byte strings (they are served as ``bytes``, or
    ``str`` with ``encoding=``) or variable-length strings (served as ``str``): UnsupportedDataset.
    """
    if info.is_text and requested is not None:
        raise UnsupportedDataset(
            f"dataset {info.key!r} holds variable-length strings ({info.vlen}), which cannot be cast to {requested}; "
            "leave its dtype unset: rows come as str"
        )
    if info.is_bytes and requested is not None:
        raise UnsupportedDataset(
            f"dataset {info.key!r} holds fixed-length byte strings ({info.dtype.str}), which cannot be cast to "
            f"{requested}; leave its dtype unset: rows come as bytes (or str with encoding=)"
        )
    return requested or info.dtype


def storage_dtype(source: np.dtype, requested: np.dtype | None) -> np.dtype:
    """What a segment stores: the narrower of source and requested, so a widening cast
    (uint8 -> float32) never multiplies node memory; the cast then happens per batch."""
    if requested is None or requested == source:
        return source
    return source if source.itemsize < requested.itemsize else requested
