"""Variable-length rows on the client: one batch gathered at once, and the forms it takes.

A backend gathers a variable-length key into a ``RaggedColumn``: the batch's values in one
fresh flat array (one vectorised ``take``, h5serve/hdf5/vlen.py ``gather``) and their lengths. The
dataset's ``ragged=`` then makes of it (``Field.batch_column``):

``"list"``    a ``RaggedList`` of 1-D tensors, one per row: views of one fresh tensor (one
              ``torch.split``), pickled to the main process as that tensor and the lengths;
``"pad"``     ``Padded(values, lengths)``: a ``(batch, longest)`` tensor filled with
              ``pad_value`` past each row's end (one masked assignment), and int64 lengths;
``"nested"``  a nested tensor of torch's jagged layout over the same flat values, no copy
              (``torch.nested.nested_tensor_from_jagged``).

Strings come as a list of ``str`` whatever ``ragged=`` says (decoded with the encoding HDF5
records for them: a Python call per row, which text needs anyway).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from ..errors import ConfigError
from ..hdf5.source import DatasetInfo
from ..hdf5.vlen import SEQ, gather, is_text, offsets_of, read_vlen

__all__ = ["LIST", "PAD", "NESTED", "RAGGED_MODES", "RaggedColumn", "RaggedSource", "RaggedList", "Padded",
           "read_ragged", "parse_ragged", "check_ragged", "fits"]

LIST, PAD, NESTED = "list", "pad", "nested"
RAGGED_MODES = (LIST, PAD, NESTED)


class Padded(NamedTuple):
    """A batch of variable-length rows padded to the longest: ``values`` (batch, longest),
    ``lengths`` (batch,) int64. Row ``i`` is ``values[i, :lengths[i]]``."""

    values: torch.Tensor
    lengths: torch.Tensor


class RaggedList(list):
    """A batch of variable-length rows as a list of 1-D tensors, views of one tensor ``flat``.

    Pickled (from DataLoader workers to the main process) as ``flat`` and the lengths, so a
    batch crosses as one shared-memory block instead of one per row; a list changed since it
    was made pickles as the plain list it then is.
    """

    def __init__(self, rows: Any = (), flat: torch.Tensor | None = None, lengths: list[int] | None = None) -> None:
        super().__init__(rows)
        self.flat = flat
        self.lengths = lengths
        self._rows = tuple(self) if flat is not None else ()

    @classmethod
    def split(cls, flat: torch.Tensor, lengths: list[int]) -> RaggedList:
        return cls(flat.split(lengths) if lengths else (), flat, lengths)

    def __reduce__(self) -> tuple[Any, ...]:
        if self.flat is not None and len(self) == len(self._rows) and all(a is b for a, b in zip(self, self._rows)):
            return (RaggedList.split, (self.flat, self.lengths))
        return (RaggedList, (list(self),))


class RaggedColumn:
    """A gathered batch of one variable-length key: ``values`` (flat, fresh, in the output
    dtype; strings: their bytes) and ``lengths`` (int64, one per row). ``kind``: h5serve/hdf5/vlen.py."""

    __slots__ = ("values", "lengths", "kind")

    def __init__(self, values: np.ndarray, lengths: np.ndarray, kind: str) -> None:
        self.values = values
        self.lengths = lengths
        self.kind = kind

    def __len__(self) -> int:
        return len(self.lengths)

    def strings(self) -> list[str]:
        """The rows as ``str``. Raised when bytes do not decode: UnicodeDecodeError."""
        blob = self.values.tobytes()
        ends = np.cumsum(self.lengths).tolist()
        starts = [0, *ends[:-1]]
        return [blob[a:b].decode(self.kind) for a, b in zip(starts, ends)]

    def rows(self) -> list[Any]:
        """One value per row: 1-D tensors (views of one fresh tensor), or ``str``."""
        if is_text(self.kind):
            return self.strings()
        return RaggedList.split(torch.from_numpy(self.values), self.lengths.tolist())

    def batch(self, ragged: str, pad_value: Any) -> Any:
        """The batch in the form ``ragged`` names (strings: always a list of ``str``)."""
        if is_text(self.kind):
            return self.strings()
        if ragged == PAD:
            return self.padded(pad_value)
        if ragged == NESTED:
            return torch.nested.nested_tensor_from_jagged(torch.from_numpy(self.values),
                                                          offsets=torch.from_numpy(offsets_of(self.lengths)))
        return self.rows()

    def padded(self, pad_value: Any) -> Padded:
        n = len(self.lengths)
        longest = int(self.lengths.max()) if n else 0
        out = np.full((n, longest), pad_value, dtype=self.values.dtype)
        if self.values.size:
            # a row-major mask: the values fill each row's first lengths[i] places, in order
            out[np.arange(longest) < self.lengths[:, None]] = self.values
        return Padded(torch.from_numpy(out), torch.from_numpy(self.lengths))


class RaggedSource:
    """Variable-length rows held as offsets and values (a read-only mapping, or memory),
    gathered by local position like gather.RowSource."""

    def __init__(self, offsets: np.ndarray, values: np.ndarray, out_dtype: np.dtype, kind: str) -> None:
        self.offsets = offsets
        self.values = values
        self.out_dtype = np.dtype(out_dtype)
        self.kind = kind

    @property
    def array(self) -> np.ndarray:  # what RowSource calls its rows
        return self.values

    def take(self, positions: torch.Tensor) -> RaggedColumn:
        flat, lengths = gather(self.offsets, self.values, positions.numpy())
        if flat.dtype != self.out_dtype:
            flat = flat.astype(self.out_dtype)
        return RaggedColumn(flat, lengths, self.kind)


def read_ragged(dset: Any, info: DatasetInfo, rows: np.ndarray, out_dtype: np.dtype) -> RaggedColumn:
    """Global ``rows`` (any order, repeats allowed) of a variable-length key, read through
    h5py in one call (each row once, in increasing order) and put in ``rows``' order.

    Raised when HDF5 cannot read them: DataError.
    """
    if len(rows) == 0:
        return RaggedColumn(np.empty(0, dtype=out_dtype), np.zeros(0, dtype=np.int64), info.vlen)
    unique, inverse = np.unique(rows, return_inverse=True)
    lo, hi = int(unique[0]), int(unique[-1]) + 1
    selection = slice(lo, hi) if hi - lo == len(unique) else unique
    lengths, values = read_vlen(dset, info.key, info.vlen, info.dtype, selection, lo, hi)
    flat, lengths = gather(offsets_of(lengths), values, inverse.reshape(-1))
    if flat.dtype != out_dtype:
        flat = flat.astype(out_dtype)
    return RaggedColumn(flat, lengths, info.vlen)


def parse_ragged(ragged: object, pad_value: object) -> tuple[str, Any]:
    """``(ragged, pad_value)`` checked. Raised when ragged is not one of RAGGED_MODES, or
    pad_value is not a number or goes without ``ragged="pad"``: ConfigError."""
    if not isinstance(ragged, str) or ragged not in RAGGED_MODES:
        raise ConfigError(f"ragged must be one of {', '.join(map(repr, RAGGED_MODES))} (how a batch of variable-length "
                          f"rows comes: a list of tensors, a padded tensor with lengths, a nested tensor), "
                          f"got {ragged!r:.80}")
    if pad_value is None:
        return ragged, 0
    if ragged != PAD:
        raise ConfigError(f"pad_value pads batches of ragged='pad'; with ragged={ragged!r} drop it")
    if isinstance(pad_value, (np.generic, np.ndarray)) and np.ndim(pad_value) == 0:
        pad_value = pad_value.item()
    if not isinstance(pad_value, (bool, int, float, complex)):
        raise ConfigError(f"pad_value must be a number (what pads rows past their end), got {pad_value!r:.80}")
    return ragged, pad_value


def check_ragged(fields: Sequence[Any], keys: Sequence[str], vlen_kinds: Sequence[str],
                 out_dtypes: Sequence[np.dtype]) -> None:
    """Raised when the fields' (fields.Field) ``ragged``/``pad_value`` ask for what no key
    has (no numeric variable-length key), or ``pad_value`` does not fit a key's dtype:
    ConfigError."""
    first = fields[0]
    if first.ragged == LIST:
        return
    numeric = [(f, d) for f, k, d in zip(fields, vlen_kinds, out_dtypes) if k == SEQ]
    if not numeric:
        raise ConfigError(
            f"ragged={first.ragged!r} shapes batches of variable-length numeric keys, but none of "
            f"{', '.join(repr(k) for k in keys)} holds variable-length sequences; drop ragged="
        )
    if first.ragged == PAD:
        for f, d in numeric:
            if not fits(f.pad_value, d):
                raise ConfigError(f"pad_value={f.pad_value!r} cannot be held by key {f.key!r}'s dtype {d}; "
                                  "pass a pad_value that can (default 0)")


def fits(value: Any, dtype: np.dtype) -> bool:
    """Whether ``value`` (a number) is exactly representable in ``dtype`` (NaN: in a float or
    complex dtype)."""
    if value != value:
        return np.dtype(dtype).kind in "fc"
    try:
        with np.errstate(all="ignore"):
            cast = np.asarray(value).astype(dtype)
        return complex(cast.item()) == complex(value)
    except (TypeError, ValueError, OverflowError):
        return False
