"""Gathering a batch of rows out of an array that holds a shard, in the output dtype.

The hot path of every backend that keeps rows in memory (a read-only shm mapping, the lazy
backend's chunk cache, the compat preload): per array and batch, one single-threaded
``np.take`` (a memcpy per row, no Python per row) into a freshly allocated array, handed
over as a tensor (``torch.from_numpy``: no copy), and, when another dtype was asked for, one
``astype`` of the gathered batch only, so every cast follows NumPy's rules. The source array
(a read-only mapping) is only ever read; every batch is new
memory, so in-place transforms of a batch are safe and reach nothing else.

Why single-threaded, and why not torch: ``torch.index_select`` (and ``.to`` for the cast)
run on torch's intra-op OpenMP pool once a batch is over ~32k elements. On a quiet machine
two threads gather a little faster than one; on a real training node something else always
holds a core (another rank, DataLoader workers, the model, another job), and the pool's
threads then wait for each other at the end of every batch: beside one busy process on two
cores, the old gather ran ~10x slower than one thread (docs/performance.md has the figures).
A batch of a few hundred rows is a few hundred microseconds of memcpy; one thread does it
at memory speed without ever waiting for another.

Threads and fork safety: the gather never sets torch's thread count and never runs on its
OpenMP pool; index handling (``as_positions``) is NumPy too, since torch's ``where``, ``to``
and ``clone`` go parallel past ~32k elements. One fork guard stays, for what h5serve does not
control here: the samplers' per-epoch ``torch.randperm`` (kept for DistributedSampler's exact
order) runs on the pool for shards of 32k rows or more, and once the pool has started, a child
that the process ``fork()``s hangs in its first parallel torch op (GNU OpenMP is not
fork-safe; measured with this torch build). So a process that gathered gives every child it
forks afterwards one torch thread (``os.register_at_fork``, client/_process.py), exactly as DataLoader does for its
workers. That touches only children, never the process itself: ``torch.get_num_threads()`` is
what the user set. A child that knows its OpenMP runtime is fork-safe may raise it again.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from . import _process

__all__ = ["IndexBatches", "RowSource", "as_column", "as_positions", "trusted_positions"]

class RowSource:
    """Rows of one array, gathered by local position into fresh tensors of ``out_dtype``.

    ``array`` is kept alive by this object (for a mapping: the mapping and its lease), and
    only ever read: it may be a read-only mapping.
    """

    def __init__(self, array: np.ndarray, out_dtype: np.dtype) -> None:
        self.array = array
        self.out_dtype = np.dtype(out_dtype)
        self._same = array.dtype == self.out_dtype
        self._tensor = self.out_dtype.kind != "S"

    def take(self, positions: torch.Tensor) -> torch.Tensor | np.ndarray:
        """Rows at ``positions`` (an int64 tensor of valid, non-negative positions, as
        ``as_positions`` returns) as a new tensor of ``out_dtype`` (byte strings: a new
        NumPy array, which torch cannot hold; see ``as_column``)."""
        if not _process.fork_guard_registered:
            _process.guard_forks()
        # mode="clip": positions are checked already (as_positions). The array's own take (not
        # np.take's Python wrapper) allocates the batch: measured ~10% faster than gathering into
        # a torch.empty tensor's buffer (out=), and with mode="raise" out= would gather into a
        # temporary and copy it again.
        rows = self.array.take(_as_array(positions), axis=0, mode="clip")
        if not self._tensor:
            return rows
        return torch.from_numpy(rows if self._same else rows.astype(self.out_dtype))


def as_column(rows: np.ndarray) -> torch.Tensor | np.ndarray:
    """A batch's gathered rows as a backend returns them: a tensor sharing their memory, or,
    for byte strings, the NumPy array itself (the dataset turns it into ``bytes`` per batch)."""
    return rows if rows.dtype.kind == "S" else torch.from_numpy(rows)


# The last positions as_positions returned and their NumPy view: each array of a batch gathers
# with the same positions, and tensor.numpy() costs ~1.5 us a call (one tuple, swapped whole,
# so a reader always sees a tensor with its own view, whatever the threads).
_last: tuple[torch.Tensor, np.ndarray] | None = None


def _as_array(positions: torch.Tensor) -> np.ndarray:
    last = _last
    return last[1] if last is not None and last[0] is positions else positions.numpy()


def _remember(positions: torch.Tensor, array: np.ndarray) -> torch.Tensor:
    global _last
    _last = (positions, array)
    return positions


def as_positions(indices: object, length: int) -> torch.Tensor:
    """Local indices (a list of ints, an array or a tensor; negatives count from the end) as a
    flat int64 CPU tensor of positions in ``[0, length)``, never a view of a bigger tensor.

    All in NumPy: torch's own ops on large index tensors would start its thread pool (see the
    module docstring). The int64 tensors h5serve's samplers hand over cost one reduction
    (~5 us in all) and are returned as they are.

    Raised when an index is out of range, or not an integer: IndexError (as for a list).
    """
    last = _last
    if last is not None and last[0] is indices:  # made by index_batches, or the last call's: compact int64
        array = last[1]
        if not array.size or np.maximum.reduce(array.view(np.uint64)) < length:
            return last[0]
        return _remember(*_checked(indices, array, length))
    if isinstance(indices, torch.Tensor):
        if (indices.dtype is torch.int64 and indices.is_cpu and indices.dim() == 1 and not indices.storage_offset()
                and indices.untyped_storage().nbytes() == indices.nbytes):
            array = indices.numpy()  # shares its memory
            # one pass: negatives are huge as unsigned, so this is "all in [0, length)"
            if not array.size or np.maximum.reduce(array.view(np.uint64)) < length:
                return _remember(indices, array)
            return _remember(*_checked(indices, array, length))
        if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
            raise IndexError(f"indices must be integers, got a tensor of {indices.dtype}")
        # another integer dtype, another device, more dimensions or a view of a bigger tensor
        # (e.g. of a whole epoch's order): a compact int64 copy, so that what the backends get
        # never keeps the rest alive
        array = indices.numpy(force=True).astype(np.int64).reshape(-1)
    else:
        array = np.asarray(indices)
        if array.dtype == np.int64 and array.ndim == 1:  # a sampler's batch (stream mode's): one pass, as above
            if not array.size or np.maximum.reduce(array.view(np.uint64)) < length:
                return _remember(torch.from_numpy(array), array)
        elif array.dtype.kind not in "iu" and array.size:
            raise IndexError(f"indices must be integers, got {array.dtype} values")
        array = array.astype(np.int64, copy=False).reshape(-1)
    return _remember(*_checked(None, array, length))


def _checked(positions: torch.Tensor | None, array: np.ndarray, length: int) -> tuple[torch.Tensor, np.ndarray]:
    """``positions`` (None: ``array`` as a tensor) with negatives counted from the end.

    Raised when an index is out of range: IndexError.
    """
    if array.size:
        lo, hi = int(np.minimum.reduce(array)), int(np.maximum.reduce(array))
        if lo < -length or hi >= length:
            raise IndexError(f"index out of range for {length} rows")
        if lo < 0:
            array = np.where(array < 0, array + length, array)
            positions = None
    return (torch.from_numpy(array) if positions is None else positions), array


class IndexBatches:
    """One pass of a batch sampler: ``order[:end]`` (an int64 tensor) cut into batches of
    ``batch_size`` indices, each counted in ``counter._yielded`` as it is handed out.

    Iterating gives compact copies: NumPy arrays when ``arrays`` (what crosses to DataLoader
    workers), else int64 tensors sharing a fresh array's memory, which ``as_positions`` takes
    without converting again. Copies, not views: torch ops on a view of the whole order cost
    time in proportion to the order (index_select: ~7 ms for 100k), and pickling one to a
    worker sends it all. A NumPy slice copy is ~2 us a batch; a torch ``clone`` ~8 us.

    ``next_view()`` is for ShmDataLoader's own iterator, in the process that gathers: the same
    batch as a NumPy view of ``order`` (the whole pass, contiguous), with no copy and no tensor;
    ``within(rows)`` checks every index of the pass at once, so no batch needs its own check.
    """

    __slots__ = ("order", "batch_size", "arrays", "_counter", "_next")

    def __init__(self, counter: Any, order: torch.Tensor, batch_size: int, end: int | None = None,
                 arrays: bool = False) -> None:
        whole = order.numpy()
        self.order: np.ndarray = np.ascontiguousarray(whole if end is None else whole[:end])
        self.batch_size = batch_size
        self.arrays = arrays
        self._counter = counter
        self._next = 0

    def __iter__(self) -> IndexBatches:
        return self

    def __next__(self) -> Any:  # a tensor, or an array when ``arrays``
        batch = self.next_view().copy()
        return batch if self.arrays else _remember(torch.from_numpy(batch), batch)

    def next_view(self) -> np.ndarray:
        """The next batch as a view of ``order``, counted as handed out.

        Raised after the last batch: StopIteration."""
        start = self._next
        view = self.order[start : start + self.batch_size]
        if not len(view):
            raise StopIteration
        self._next = start + len(view)
        self._counter._yielded += len(view)
        return view

    def within(self, rows: int) -> bool:
        """Whether every index of the pass is a position in ``[0, rows)`` (one pass over the
        order: negatives are huge as unsigned)."""
        return not self.order.size or bool(np.maximum.reduce(self.order.view(np.uint64)) < rows)


def trusted_positions(array: np.ndarray) -> torch.Tensor:
    """``array`` (int64 positions already known to lie in range, e.g. a view ``IndexBatches.within``
    vouched for) as the tensor the backends take, with no check; ``RowSource.take`` gathers
    with ``array`` itself."""
    return _remember(torch.from_numpy(array), array)
