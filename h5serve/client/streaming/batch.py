"""``StreamBatch``: what a stream sampler yields for each batch (client/streaming/sampler.py) and
the dataset reads: the rows, and which blocks the window holds, takes next, uses for the last
time and lets a DataLoader worker keep (client/streaming/blockcache.py and
client/streaming/daemon_blocks.py act on them)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["StreamBatch"]


class StreamBatch:
    """A stream sampler's batch: ``rows`` (int64 global rows, in order); ``alive``, the
    blocks the node's window holds at this step (the cache frees any other); ``ahead``, the
    blocks the window takes next, by first use (a daemon-backed window asks for them early:
    client/streaming/daemon_blocks.py); ``done``, the blocks whose last use on this rank is this batch;
    ``keep``, when DataLoader workers gather the batches, the blocks the worker that gathers
    this one may keep mapped after it (None: no workers, or a sampler not told of them)."""

    __slots__ = ("rows", "alive", "ahead", "done", "keep")

    def __init__(self, rows: np.ndarray, alive: np.ndarray, ahead: np.ndarray | None = None,
                 done: np.ndarray | None = None, keep: np.ndarray | None = None) -> None:
        self.rows = rows
        self.alive = alive
        self.ahead = _EMPTY if ahead is None else ahead
        self.done = _EMPTY if done is None else done
        self.keep = keep

    def __len__(self) -> int:
        return len(self.rows)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self.rows if dtype is None else self.rows.astype(dtype)

    def __reduce__(self) -> tuple[Any, ...]:
        return (StreamBatch, (self.rows, self.alive, self.ahead, self.done, self.keep))

    def __repr__(self) -> str:
        keep = "" if self.keep is None else f", keep={self.keep.tolist()}"
        return (f"StreamBatch(rows={len(self.rows)}, alive={self.alive.tolist()}, ahead={self.ahead.tolist()}, "
                f"done={self.done.tolist()}{keep})")


_EMPTY = np.zeros(0, dtype=np.int64)
