"""One field of a compound (structured) HDF5 dataset, read as if it were a dataset of its own.

A key names a field as ``"<dataset>:<field>"`` (``"events:energy"``): PyTables tables and
other structured datasets give every field its own rows, and a training job usually wants a
few numeric fields of them, each as its own array. The rule for the ``:``, since HDF5 names
may contain one too:

1. a key that names an existing object in the file is that object (a dataset literally
   named ``"a:b"`` wins);
2. otherwise the key is split at a ``:`` whose left side exists, the rightmost such ``:``
   first: ``"runs:2024:energy"`` is field ``energy`` of ``runs:2024`` when that dataset
   exists, else field ``2024:energy`` of ``runs``.

Only the named field is read: HDF5 converts a compound by member name, so reading into an
array whose type is a compound of that one member reads nothing else (``FieldRows``).
Shared by the daemon's loader and the client's lazy and memory backends (the client never
imports ``h5serve.daemon``).
"""

from __future__ import annotations

from typing import Any

import h5py
import numpy as np

__all__ = ["FIELD_SEP", "split_field", "FieldRows", "rows_dataset"]

FIELD_SEP = ":"


def _exists(f: h5py.File, name: str) -> bool:
    try:
        return name in f
    except (ValueError, TypeError, OSError):  # a name HDF5 refuses: it names nothing
        return False


def split_field(f: h5py.File, key: str) -> tuple[str, str]:
    """``(dataset key, field name)`` for ``key`` in ``f`` (field ``""``: a plain dataset key),
    by the rule in the module docstring. A key whose parts exist nowhere stays whole, so the
    error about it names the key as given."""
    if FIELD_SEP not in key or _exists(f, key):
        return key, ""
    at = len(key)
    while (at := key.rfind(FIELD_SEP, 0, at)) > 0:
        if _exists(f, key[:at]):
            return key[:at], key[at + 1:]
    return key, ""


class FieldRows:
    """A compound dataset seen through one field: ``read_direct`` fills a plain array of the
    field's dtype (rows, then the dataset's other dimensions, then the field's own shape)
    with that field alone; everything else (``file``, ``id``, ``shape``, ``chunks``, ...) is
    the dataset's, so its storage (where its rows sit in the file) is the dataset's own."""

    def __init__(self, dset: h5py.Dataset, field: str) -> None:
        self.dset = dset
        self.field = field
        sub = dset.dtype.fields[field][0]
        self._field_shape = sub.shape
        self._memory = np.dtype([(field, sub.base.newbyteorder("="), sub.shape)])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dset, name)

    def read_direct(self, dest: np.ndarray, source_sel: Any = None, dest_sel: Any = None) -> None:
        """h5py's ``read_direct`` of the field into ``dest`` (C-contiguous, the field's base dtype)."""
        if dest.size == 0:
            return
        if not dest.flags.c_contiguous:
            raise ValueError("FieldRows.read_direct needs a C-contiguous destination")
        lead = dest.shape[: dest.ndim - len(self._field_shape)]
        view = dest.reshape(*lead, -1).view(self._memory).reshape(lead)
        self.dset.read_direct(view, source_sel, dest_sel)


def rows_dataset(f: h5py.File, key: str) -> h5py.Dataset | FieldRows:
    """What reads the rows of ``key`` (a dataset, or a field of one): ``f[key]``, or a
    FieldRows of the compound dataset. Check the key with ``source.inspect_dataset`` first."""
    dataset, field = split_field(f, key)
    return FieldRows(f[dataset], field) if field else f[dataset]
