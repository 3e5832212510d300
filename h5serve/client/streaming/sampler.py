"""StreamSampler: stream mode's batches for one rank (h5serve/order/stream_order.py has the order).

Each epoch the file's blocks are permuted and dealt to the nodes; a node's rows are drawn
through a window of ``window`` blocks and dealt to its local ranks, every rank of every node
the same samples and batches. Each batch is a ``StreamBatch``: the rows, and the blocks the
node's window holds at that step, so that the dataset frees the others
(client/streaming/blockcache.py). The same order whether the rows come from a daemon or from h5py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from ...errors import ConfigError
from ...order.equalise import check_batch_size
from ...order.stream_order import BlockLayout, NodeEpoch, max_node_blocks, node_epoch, node_rows, window_for
from ...util.checks import is_int
from ..samplers.node import NodePlace
from ..samplers.resharding import check_not_resharded
from ..samplers.shuffle import check_state_origin
from .batch import StreamBatch

__all__ = ["StreamSampler"]

_STATE_KEYS = ("sampler", "mode", "total_rows", "block_rows", "window", "seed", "shuffle", "drop_last", "epoch",
               "num_nodes", "node_rank", "local_rank", "local_world_size", "offset", "consumed", "consumed_node")


class StreamSampler(Sampler[StreamBatch]):
    """Batches (``StreamBatch``: global rows, and the node window's blocks at that step) of a
    stream-mode dataset for the rank at ``place``.

    ``capacity``: blocks the node's window holds (make_loader passes
    ``dataset.stream.config.capacity_for(workers)``); the order's window is
    ``stream_order.window_for`` of it (every block of the node when they fit; else ``capacity``
    less the blocks one step of batches can start), or ``window`` when given (it must fit
    ``capacity`` the same way).

    ``workers``, ``prefetch_factor``: the DataLoader's, when its workers gather the batches
    (make_loader passes them). Each batch then says which blocks the worker that gathers it may
    keep mapped afterwards (``StreamBatch.keep``): a worker runs batches ahead of the one its
    rank waits for, and the blocks it holds while idle must leave that batch room
    (client/streaming/daemon_blocks.py).

    ``set_epoch(epoch)`` before each epoch. ``state_dict(consumed=n)`` records seed, epoch,
    window, layout and the samples this rank has consumed; ``load_state_dict`` resumes that
    epoch where it stopped with the same layout, and with another number of ranks per node as
    long as the number of nodes is the same (the rows the node has not served yet are dealt to
    the new ranks: each still seen once). Another number of nodes deals the blocks otherwise:
    resume at the next epoch with ``next_epoch=True``.

    Raised for a bad batch size or place, fewer blocks than nodes, a window too small for one
    batch on every local rank, or when ``drop_last`` leaves every rank without a batch:
    ConfigError.
    """

    mode = "stream"

    def __init__(self, layout: BlockLayout, batch_size: int, place: NodePlace, capacity: int, *,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, window: int | None = None,
                 block_bytes: int = 0, workers: int = 0, prefetch_factor: int = 2) -> None:
        if not isinstance(place, NodePlace):
            raise ConfigError(f"place must be a NodePlace, got {type(place).__name__}")
        check_batch_size(batch_size)
        self.set_workers(workers, prefetch_factor)
        self.layout, self.batch_size, self.place, self.capacity = layout, batch_size, place, int(capacity)
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.block_bytes = int(block_bytes)
        self.node_rows = node_rows(layout, place.num_nodes)
        self.window = self._fit(window)
        self.epoch = 0
        self.arrays = True  # batches are StreamBatches of numpy rows either way
        self._offset = 0  # node rows served before this pass (a resume)
        self._run: int | None = None  # runs this epoch was drawn in, when not this node's ranks (a resume)
        self._start = 0  # samples of this pass already consumed (a resume, same layout)
        self._yielded = 0
        self._plan: tuple[tuple[int, int, int | None], NodeEpoch] | None = None
        self.epoch_plan()  # raises now for a layout that cannot be dealt

    def set_workers(self, workers: int, prefetch_factor: int = 2) -> None:
        """The DataLoader workers that gather the batches and their ``prefetch_factor`` (0
        workers: the rank gathers them), which say what a worker keeps mapped between its batches
        (``StreamBatch.keep``); the order is the same whatever they are.

        Raised when either is not an integer >= 0: ConfigError."""
        for name, value in (("workers", workers), ("prefetch_factor", prefetch_factor)):
            if not is_int(value, numpy=True) or value < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
        self.workers = int(workers)
        # how far behind a worker's batch the oldest batch the node may still be gathering is: the
        # loader hands its workers at most workers x prefetch_factor batches past the one its rank
        # waits for, and the node's other ranks wait for one a step earlier at most (a collective a step)
        self.behind = self.workers * max(int(prefetch_factor), 1) + 1 if self.workers else 0

    def _fit(self, window: int | None) -> int:
        """The order's window: ``window`` if given, else the largest ``capacity`` allows.

        Raised when it does not fit ``capacity``: ConfigError."""
        blocks = max(max_node_blocks(self.layout, self.place.num_nodes, self.place.node_rank), 1)
        best = window_for(self.capacity, blocks, self.layout.block_rows, self.batch_size,
                          self.place.local_world_size, self.block_bytes)
        if window is None:
            return best
        if int(window) > best and int(window) < blocks:
            raise ConfigError(
                f"the saved order reads through a window of {window} blocks, but this job's window holds "
                f"{self.capacity} blocks, room for a window of {best} with batches of {self.batch_size} on "
                f"{self.place.local_world_size} local ranks: resume with a window as large as the saved one, or "
                "at the next epoch (load_state_dict(state, next_epoch=True))")
        return int(window)

    @property
    def sampler(self) -> StreamSampler:
        """Itself: Lightning sets each epoch through ``loader.batch_sampler.sampler.set_epoch``."""
        return self

    @property
    def total_rows(self) -> int:
        return self.layout.total_rows

    def set_epoch(self, epoch: int) -> None:
        if int(epoch) != self.epoch:
            self._offset, self._start, self._run = 0, 0, None  # a pending resume applies to its epoch only
        self.epoch = int(epoch)

    def epoch_plan(self) -> NodeEpoch:
        """This node's epoch as dealt to its ranks (from the resume point, if any)."""
        key = (self.epoch, self._offset, self._run)
        if self._plan is None or self._plan[0] != key:
            p = self.place
            plan = node_epoch(self.layout, seed=self.seed, epoch=self.epoch, num_nodes=p.num_nodes,
                              node=p.node_rank, window=self.window, local_world_size=p.local_world_size,
                              batch_size=self.batch_size, drop_last=self.drop_last, shuffle=self.shuffle,
                              offset=self._offset, run=self._run)
            self._plan = (key, plan)
        return self._plan[1]

    def indices(self) -> np.ndarray:
        """This rank's rows for the pass (from the resume point, if any)."""
        return self.epoch_plan().rank_rows(self.place.local_rank)

    def _window(self, plan: NodeEpoch, first_batch: int) -> Any:
        """``window(b) -> (alive, ahead, keep)``: the blocks the node's window holds at step ``b``
        (a batch on each local rank), those first used at or before it and last used at or after
        it; the blocks it takes next, by first use, as many as the window has room for once full
        (``capacity - max(alive, window)``; all of them when the node's blocks fit); and with
        ``workers``, what the worker that gathers batch ``b`` may keep mapped after it (None
        without workers: the rank itself keeps what its window holds).

        While the window ramps up (an epoch's first blocks, h5serve/order/stream_order.py) it has
        more room, but prefetching into that got the prefetched blocks (unmapped, so not held)
        evicted by the daemon's LRU before their use and loaded twice (595 loads instead of 387
        in the first 300 batches of 0.5 GB).

        ``keep``: the blocks alive at every step from the oldest batch the node's loaders may
        still be gathering (``b - behind``, none before ``first_batch``, this pass's first) to the
        worker's next batch (``b + workers``, round robin). An idle worker then holds only blocks
        that the batch every rank waits for may need too, so that batch finds room (each process
        maps one block at a time; one that waits for room holds none); keeping what its own next
        batch needs, the blocks started since that oldest batch included, left it none."""
        step = self.batch_size * plan.local_world_size
        by_first = np.argsort(plan.first_use, kind="stable")
        first, last = plan.first_use[by_first] // step, plan.last_use[by_first] // step
        blocks = plan.blocks[by_first]
        life = int((last - first).max()) if len(first) else 0
        full = self.window if self.window < len(blocks) else 0  # the node's blocks all fit: prefetch them all

        # a step's arrays are the previous step's objects when they did not change (no block
        # started or ended between them): the cache sees that by identity and skips the step
        ending = np.bincount(last, minlength=1) if len(last) else np.zeros(1, dtype=np.int64)
        said: dict[str, Any] = {"b": None, "lo": -1, "hi": -1, "alive": blocks[:0], "ahead": blocks[:0]}

        def window(b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
            lo, hi = int(np.searchsorted(first, b - life)), int(np.searchsorted(first, b, side="right"))
            same = (said["b"] == b - 1 and (lo, hi) == (said["lo"], said["hi"])
                    and not (0 <= b - 1 < len(ending) and ending[b - 1]))
            if not same:
                alive = blocks[lo:hi][last[lo:hi] >= b]
                if not np.array_equal(alive, said["alive"]):
                    said["alive"] = alive
                ahead = blocks[hi : hi + max(self.capacity - max(len(said["alive"]), full), 0)]
                if not np.array_equal(ahead, said["ahead"]):
                    said["ahead"] = ahead
            said.update(b=b, lo=lo, hi=hi)
            alive, ahead = said["alive"], said["ahead"]
            if not self.workers:
                return alive, ahead, None
            after = b + self.workers
            since = int(np.searchsorted(first, after - life))
            until = int(np.searchsorted(first, max(b - self.behind, first_batch), side="right"))
            return alive, ahead, blocks[since:until][last[since:until] >= after]

        return window

    def _done(self, rows: np.ndarray) -> dict[int, np.ndarray]:
        """Batch number -> the blocks whose last use on this rank is in that batch."""
        if not len(rows):
            return {}
        ids = self.layout.block_of(rows)
        last = np.full(self.layout.n_blocks, -1, dtype=np.int64)
        np.maximum.at(last, ids, np.arange(len(ids)))  # each block's last position here, in O(rows)
        blocks = np.flatnonzero(last >= 0)
        last_batch = last[blocks] // self.batch_size
        order = np.argsort(last_batch, kind="stable")
        batches, starts = np.unique(last_batch[order], return_index=True)
        return {int(b): blocks[order][a:z] for b, a, z in zip(batches, starts, [*starts[1:], len(order)])}

    def __iter__(self) -> Iterator[StreamBatch]:
        check_not_resharded(self)
        return self._batches()

    def _batches(self) -> Iterator[StreamBatch]:
        plan = self.epoch_plan()
        rows = plan.rank_rows(self.place.local_rank)
        done = self._done(rows)
        start, self._start = self._start, 0
        self._yielded = start
        window = self._window(plan, start // self.batch_size)
        for b in range(start // self.batch_size, plan.batches):
            lo = max(b * self.batch_size, start)
            batch = np.ascontiguousarray(rows[lo : (b + 1) * self.batch_size])
            self._yielded += len(batch)
            alive, ahead, keep = window(b)
            yield StreamBatch(batch, alive, ahead, done.get(b), keep)

    def __len__(self) -> int:
        plan = self.epoch_plan()
        return -(-max(plan.samples - self._start, 0) // self.batch_size)

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """What to checkpoint next to the model. ``consumed``: samples of this pass this rank
        has trained on (default: handed out so far; with workers pass
        ``batches_done * batch_size``: they prefetch). ``consumed_node`` is how many rows of
        its sequence the node has served (every local rank the same)."""
        plan = self.epoch_plan()
        consumed = self._yielded if consumed is None else int(consumed)
        if not 0 <= consumed <= plan.samples:
            raise ConfigError(f"consumed must be in [0, {plan.samples}] (samples per rank in this pass), "
                              f"got {consumed}")
        p = self.place
        return {"sampler": type(self).__name__, "mode": self.mode, "total_rows": self.total_rows,
                "block_rows": self.layout.block_rows, "window": self.window, "seed": self.seed,
                "shuffle": self.shuffle, "drop_last": self.drop_last, "epoch": self.epoch,
                "num_nodes": p.num_nodes, "node_rank": p.node_rank, "local_rank": p.local_rank,
                "local_world_size": p.local_world_size, "offset": self._offset, "consumed": consumed,
                "consumed_node": self._offset + consumed * p.local_world_size,
                "file_rows": list(self.layout.file_rows),
                "run": p.local_world_size if self._run is None else self._run}

    def load_state_dict(self, state: dict[str, Any], *, next_epoch: bool = False) -> None:
        """Resume from ``state_dict()`` (see the class). ``next_epoch=True``: start at the
        beginning of the next epoch instead (any layout).

        Raised when the state is malformed, from another sampler kind or file, or (without
        ``next_epoch``) from other blocks, another number of nodes, or a window this job
        cannot hold: ConfigError."""
        check_state_origin(self, state, _STATE_KEYS, "total_rows", self.total_rows)
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        if next_epoch:
            self.epoch, self._offset, self._start, self._yielded = int(state["epoch"]) + 1, 0, 0, 0
            self._run, self._plan = None, None
            return
        here: tuple[tuple[str, object], ...] = (("block_rows", self.layout.block_rows),
                                                ("num_nodes", self.place.num_nodes),
                                                ("node_rank", self.place.node_rank))
        differ = {k: (state[k], v) for k, v in here if state[k] != v}
        files = [int(n) for n in state.get("file_rows", ())]  # many files: the blocks are laid out per file
        if files != list(self.layout.file_rows):
            differ["file_rows"] = (_files_said(files), _files_said(list(self.layout.file_rows)))
        if differ:
            said = ", ".join(f"{k}={a} (this job: {b})" for k, (a, b) in differ.items())
            raise ConfigError(
                f"stream sampler state was saved with {said}: the blocks are dealt to nodes by their number and "
                "size, so a mid-epoch resume needs the same blocks and nodes; resume with them, or start at the "
                "next epoch with load_state_dict(state, next_epoch=True)")
        self.window = self._fit(int(state["window"]))
        self.epoch = int(state["epoch"])
        same = (state["local_world_size"], state["local_rank"], bool(state["drop_last"])) == (
            self.place.local_world_size, self.place.local_rank, self.drop_last)
        self._offset, self._start = (int(state["offset"]), int(state["consumed"])) if same else (
            int(state["consumed_node"]), 0)
        run = state.get("run", 0)  # a state without it was saved by a version that drew uniform keys (run 0)
        if not is_int(run, numpy=True) or run < 0:
            raise ConfigError(f"stream sampler state has run={run!r}: not a state_dict() of this sampler")
        self._run = None if run == self.place.local_world_size else int(run)
        self._plan = None
        plan = self.epoch_plan()
        if not 0 <= self._start <= plan.samples:
            raise ConfigError(f"sampler state has consumed={state['consumed']!r} outside [0, {plan.samples}] "
                              "(samples per rank): resume with the batch size it was saved with")
        self._yielded = self._start


def _files_said(file_rows: list[int]) -> str:
    """Many files' rows for a message: ``3 files of 300, 77, 800 rows``; one file: ``one file``."""
    if not file_rows:
        return "one file"
    shown = ", ".join(map(str, file_rows[:4])) + (", ..." if len(file_rows) > 4 else "")
    return f"{len(file_rows)} files of {shown} rows"
