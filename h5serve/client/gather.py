"""Gathering a batch of rows out of an array that holds a shard, in the output dtype.

The hot path of every backend that keeps rows in memory (a read-only shm mapping, the lazy
backend's chunk cache, the compat preload): one ``torch.index_select`` per array per batch
(a memcpy per row on torch's thread pool, no Python per row), then the cast on the gathered
batch only. Casts that are not exact ("safe" in NumPy's terms) and dtypes torch lacks go
through NumPy, so every cast follows NumPy's rules.

Fork safety, and why this module touches torch's thread count: once a process has used
torch's OpenMP pool, a child it ``fork()``s hangs in its first parallel torch op (GNU OpenMP
is not fork-safe). DataLoader escapes this by giving its workers one thread; a process that
gathered here does the same for every child it forks afterwards (``os.register_at_fork``),
so using a dataset never makes a later ``fork`` hang.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import torch

__all__ = ["RowSource", "as_positions"]

_TORCH_DTYPES = {
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
}
_fork_guard_registered = False


def _one_torch_thread() -> None:
    torch.set_num_threads(1)


def _guard_forks() -> None:
    global _fork_guard_registered
    if not _fork_guard_registered:
        os.register_at_fork(after_in_child=_one_torch_thread)
        _fork_guard_registered = True


def _readonly_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``array``'s memory, which may be a read-only mapping. Only ever read
    (index_select copies out): writing through it would fault, and it never reaches users."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given NumPy array is not writable"
        return torch.from_numpy(array)


class RowSource:
    """Rows of one array, gathered by local position into fresh tensors of ``out_dtype``.

    ``array`` is kept alive by this object (for a mapping: the mapping and its lease).
    """

    def __init__(self, array: np.ndarray, out_dtype: np.dtype) -> None:
        self.array = array
        self.out_dtype = np.dtype(out_dtype)
        torch_in, torch_out = _TORCH_DTYPES.get(array.dtype), _TORCH_DTYPES.get(self.out_dtype)
        self._tensor = _readonly_tensor(array) if torch_in is not None and array.flags.c_contiguous else None
        same = array.dtype == self.out_dtype
        exact = np.can_cast(array.dtype, self.out_dtype, "safe")
        self._torch_cast = torch_out if not same and exact and torch_out is not None else None
        self._numpy_cast = not same and self._torch_cast is None

    def take(self, positions: torch.Tensor) -> torch.Tensor:
        """Rows at ``positions`` (an int64 tensor of valid, non-negative positions)."""
        if self._tensor is None:
            rows = np.take(self.array, positions.numpy(), axis=0)
            return torch.from_numpy(rows if rows.dtype == self.out_dtype else rows.astype(self.out_dtype))
        _guard_forks()
        gathered = torch.index_select(self._tensor, 0, positions)
        if self._torch_cast is not None:
            return gathered.to(self._torch_cast)
        if self._numpy_cast:
            return torch.from_numpy(gathered.numpy().astype(self.out_dtype))
        return gathered


def as_positions(indices: object, length: int) -> torch.Tensor:
    """Local indices (a list of ints, an array or a tensor; negatives count from the end) as a
    flat int64 tensor of positions in ``[0, length)``.

    Raised when an index is out of range: IndexError (as for a list).
    """
    if isinstance(indices, torch.Tensor):
        positions = indices.reshape(-1)
        if positions.storage_offset() or positions.untyped_storage().nbytes() > positions.nbytes:
            positions = positions.clone()  # a view of a bigger tensor slows index_select in proportion to it
        if positions.dtype != torch.int64:
            if positions.dtype.is_floating_point or positions.dtype == torch.bool:
                raise IndexError(f"indices must be integers, got a tensor of {positions.dtype}")
            positions = positions.to(torch.int64)
    else:
        array = np.asarray(indices)
        if array.dtype.kind not in "iu" and array.size:
            raise IndexError(f"indices must be integers, got {array.dtype} values")
        positions = torch.from_numpy(array.astype(np.int64, copy=False).reshape(-1))
    if positions.numel():
        lo, hi = int(positions.min()), int(positions.max())
        if lo < -length or hi >= length:
            raise IndexError(f"index out of range for {length} rows")
        if lo < 0:
            positions = torch.where(positions < 0, positions + length, positions)
    return positions
