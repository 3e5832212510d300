"""Stream mode served by the node's daemon: every block (h5serve/order/stream_order.py) of every key
is one segment, asked for by its global rows (``Acquire(mode="stream", rows=(a, b))``; of many
files, by its rows in the one file that holds it: a one-file acquire, ``files`` empty), so
the ranks and jobs of a node that read the same block share one copy in shared memory and
one load (the daemon's loads are single-flight; its loader processes load blocks side by
side, ``--loaders``).

Per process (a rank, or a DataLoader worker), ``DaemonBlocks``:

- *whole keys*: a key whose rows are small beside the budget (labels; ``stream.whole_keys``)
  is one global segment, asked for with the first prefetch, mapped at its first use and held
  until the dataset closes; only the other keys go block by block.
- *prefetch*: every batch carries the blocks its node's window takes next (``StreamBatch.ahead``,
  by first use, as many as the window has room for); an acquire is sent for each without
  waiting (the daemon answers "loading" at once and starts the load). Prefetched blocks are
  not mapped until a batch needs them, so the daemon may evict them again if a block a rank
  needs now must have the room: a prefetch never holds memory another rank waits for.
- *attach*: a block a batch needs is waited for (``DaemonClient.acquire``) and mapped
  read-only (``segments.open_segment``: by name, or the descriptor the daemon hands a
  ``--group`` member); its shared lease keeps it from eviction while mapped.
- *release*: a block's mappings are closed right after its last use on this rank
  (``StreamBatch.done``), and any block outside the node's window at this step
  (``StreamBatch.alive``) is closed too; once every rank and job of the node has closed it,
  the daemon may evict it (LRU under ``--max-memory``). A dead rank's leases go with it (the
  kernel drops its flocks).
- *workers*: a DataLoader worker gathers batches ahead of the one its rank waits for, so the
  node's processes map blocks of several steps at once, more than the window holds once blocks
  start within those steps. After each batch a worker keeps only ``StreamBatch.keep``: the
  blocks alive from the oldest batch the node may still be gathering to the worker's next one
  (client/streaming/sampler.py), never those started since that oldest batch. So an idle worker
  (its batches done, its next one sent only once its rank has taken the batch it waits for)
  holds nothing that batch lacks room for: idle workers that had run ahead used to hold the
  blocks of later steps while the batch every rank waited for found no room, until its
  ``timeout=``. Without ``keep`` (a sampler not told of the workers) a worker keeps nothing.
- *room*: when the daemon refuses a needed block because its budget is full of blocks
  other ranks or jobs still hold (BudgetExceeded), the rank closes the blocks it maps (so that
  two ranks apart by a few steps never each wait for the other's blocks) and asks again with
  backoff until ``wait_s`` (``timeout=``, default DEFAULT_WAIT_S); so it does when the daemon
  fails the load because its shm filesystem is full (ShmFull: other files there), and when it
  refuses to queue the load because this user already has as many loads waiting for a loader as
  one user may (CapacityError). Then it fails with that class, naming the block, the window, the
  budget and the blocks it holds. Nothing waits forever; the daemon and the other ranks carry
  on, and the node serves the next job once there is room.
- *depth*: a process has at most PREFETCH_DEPTH blocks asked for and not mapped; a prefetch
  refused (CapacityError: the budget, the shm filesystem or the load queue) stops there until the
  next batch. A window of thousands of tiny blocks used to ask for all of them at its first batch,
  and the daemon's refusal past the loads one user may queue failed that batch.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from ...errors import CapacityError, SegmentError
from ...hdf5.source import DatasetInfo
from ...order.sharding import STREAM
from ...order.stream_order import BlockLayout
from ...segments import HEADER_SIZE, AttachedSegment
from ...segments.stitch import can_stitch
from ...wire.connection import DaemonClient
from ...wire.protocol import Acquire, AcquireResult
from ..backends.attach import EvictionRetry, attach_asking_again
from ..gather import as_column
from ..ragged import RaggedColumn
from ..spec import BackendSpec
from .arena_blocks import ArenaBlocks, arenas_used
from .blockcache import Arrays, gather_by_block
from .refusal import NoRoom
from .stitched import StitchedBlocks
from .whole_keys import WholeKeys
from .window_fit import mappable_blocks, past_the_cap

__all__ = ["DaemonBlocks", "DEFAULT_WAIT_S", "PREFETCH_DEPTH", "STITCH_ENV"]

log = logging.getLogger("h5serve.client")

_NONE, _ASKED, _HELD = 0, 1, 2  # what a process has of a block (DaemonBlocks._state)
STITCH_ENV = "H5SERVE_STITCH"  # "0": gather a block at a time (the benchmark compares both)
DEFAULT_WAIT_S = 120.0  # how long a needed block may wait for room in the daemon's budget (timeout= overrides)
_FIRST_BACKOFF_S, _MAX_BACKOFF_S = 0.01, 0.5
# blocks a process asks for ahead (prefetches, and its window's blocks not mapped yet) and has not
# mapped: enough to keep the daemon's loaders busy, and far below the loads one user may queue
# (the daemon's MAX_QUEUED_LOADS_PER_UID), which a window of thousands of tiny blocks filled
PREFETCH_DEPTH = 64


class DaemonBlocks:
    """The blocks of ``layout`` of the datasets ``infos`` as daemon segments, at most
    ``capacity`` mapped by this process at a time (more only while one batch spans more);
    ``gather`` returns rows in ``out_dtypes``. Picklable: a spawned worker connects anew."""

    def __init__(self, spec: BackendSpec, infos: list[DatasetInfo], out_dtypes: list[np.dtype], layout: BlockLayout,
                 capacity: int, budget: int, block_cost: int, whole: Sequence[bool] = (),
                 arena_offered: bool = False) -> None:
        self.spec, self.infos, self.layout = spec, infos, layout
        self.whole = [bool(w) for w in whole] or [False] * len(infos)  # keys held whole, not block by block
        self.out_dtypes = [np.dtype(d) for d in out_dtypes]
        streamed = [i for i, w in enumerate(self.whole) if not w]
        self._streamed = ([infos[i] for i in streamed], [self.out_dtypes[i] for i in streamed])  # block by block
        self.capacity, self.budget, self.block_cost = int(capacity), int(budget), int(block_cost)
        self.wait_s = DEFAULT_WAIT_S if spec.timeout is None else float(spec.timeout)
        self._no_room = NoRoom(bool(spec.files), self.wait_s, self.capacity, self.block_cost, self.budget)
        # fixed-size rows: every key's blocks side by side, one gather a batch (stitched.py)
        self._stitch = (bool(self._streamed[0]) and not any(i.vlen for i in self._streamed[0])
                        and can_stitch(HEADER_SIZE) and os.environ.get(STITCH_ENV, "1") != "0")
        # the daemon's arenas instead of a segment per block
        self._use_arena = arenas_used(self._stitch and not spec.files and spec.pin is None, arena_offered)
        self._reset()
        if self._arena is None and self.mapped_cap < min(self.capacity, self.layout.n_blocks):
            warnings.warn(past_the_cap(self.capacity, self.mapped_cap), RuntimeWarning, stacklevel=2)

    def _reset(self) -> None:
        self._pid = os.getpid()
        # the blocks this process keeps mapped: the window's, or fewer where the kernel's limits on mappings
        # and descriptors come first (100,000s of small blocks): past them the least recently used block is
        # unmapped here (the daemon keeps it loaded) and mapped again when needed (order, memory unchanged)
        self.mapped_cap = min(self.capacity, mappable_blocks(len(self._streamed[0]), self._stitch, PREFETCH_DEPTH))
        self._keeps_all = self.mapped_cap >= self.layout.n_blocks  # the window holds every block: kept mapped
        self._stitched = (StitchedBlocks(self.layout, len(self._streamed[0]), self.mapped_cap)
                          if self._stitch and not self._use_arena else None)
        self._arena = (ArenaBlocks(self.layout, len(self._streamed[0]), self._requests, self.client, self._no_room,
                                   PREFETCH_DEPTH, self._keeps_all, self._waited_for_room) if self._use_arena else None)
        self._client: DaemonClient | None = None
        self._held: OrderedDict[int, list[AttachedSegment]] = OrderedDict()
        # per block: _NONE, _ASKED (in _asked) or _HELD (in _held), so that a step's window is
        # compared with what this process has in numpy, not a Python loop over the window
        self._state = np.zeros(max(self.layout.n_blocks, 1), dtype=np.int8)
        self._inside = np.zeros(len(self._state), dtype=bool)  # _outside's mask, all False between calls
        self._asked: dict[int, list[AcquireResult]] = {}  # prefetched: acquires sent, not mapped yet
        self._wholes = WholeKeys(self.spec, self.whole, self.out_dtypes)  # keys held whole
        self._partial: list[AttachedSegment | None] = []  # the keys of the block being mapped, mapped so far
        # the window a step's retain and prefetch last acted on (the sampler hands the same array
        # objects while its window does not change): the same again, and nothing closed or
        # refused since, is nothing to do, so a step costs nothing per block of the window
        self._retained: np.ndarray | None = None
        self._prefetched: tuple[np.ndarray, np.ndarray] | None = None
        self.attaches = 0  # blocks mapped by this process
        self.peak = 0  # most blocks mapped at once
        self.budget_waits = 0  # times a needed block waited for room (the daemon's budget, or its shm filesystem)
        self.ready_waits = 0  # needed blocks that were not loaded yet when a batch needed them
        self.yields = 0  # times this process let its mapped blocks go while it waited for room
        self.waited_s = 0.0  # seconds spent waiting for needed blocks (loads and room)

    def _check_pid(self) -> None:
        if self._pid != os.getpid():
            # a forked worker: the parent's mappings and socket are not this process's to use or
            # close (closing an inherited fd would not drop the parent's lease, but the parent's
            # ZeroMQ context must never be touched here); dropped, the worker maps its own (its
            # copy of the stitched blocks' address range unmapped: the parent's stays)
            if self._stitched is not None:
                self._stitched.close()
            if self._arena is not None:
                self._arena.close()  # in the child: unmapped, its parent's leases left alone
            self._reset()

    @property
    def reads(self) -> int:
        """Blocks mapped by this process (BlockCache's name: blocks it read)."""
        return self.attaches

    @property
    def held(self) -> list[int]:
        """The blocks mapped now, least recently used first."""
        self._check_pid()
        return list(self._held)

    def client(self) -> DaemonClient:
        if self._client is None:
            self._client = DaemonClient(self.spec.runtime_dir, self.spec.timeout, self.spec.daemon_user)
        return self._client

    def _requests(self, block: int, prefetch: bool = False) -> list[Acquire]:
        """One acquire per key for ``block``; of many files, the block's rows of the one file that
        holds them (a block never spans two): the segment is that file's, shared with any job
        that reads the file, alone or in another set."""
        pin = self.spec.pin
        if self.spec.files:
            index, a, b = self.layout.locate(block)
            path = self.spec.files[index]
            pin = self.spec.pins[index] if self.spec.pins else None  # many s3:// objects: this one's identity
        else:
            (a, b), path = self.layout.span(block), self.spec.path
        sel = self.spec.selection
        return [Acquire(path, key, sel.world_size, sel.rank, STREAM, None if dtype is None else dtype.str,
                        rows=(a, b), prefetch=prefetch, pin=pin)
                for key, dtype, whole in zip(self.spec.keys, self.spec.dtypes, self.whole) if not whole]

    # ----- the window -------------------------------------------------------------------------
    def _outside(self, state: int, *windows: np.ndarray) -> np.ndarray:
        """The blocks in ``state`` that none of ``windows`` holds (ascending). One vectorised
        pass over the blocks' states (a mask kept between calls, not allocated each time):
        cheaper than a Python pass over the thousands of blocks a large window holds."""
        if not (self._held if state == _HELD else self._asked):
            return np.zeros(0, dtype=np.int64)
        inside = self._inside
        for window in windows:
            inside[np.asarray(window, dtype=np.int64)] = True
        try:
            return np.flatnonzero((self._state == state) & ~inside)
        finally:
            for window in windows:
                inside[np.asarray(window, dtype=np.int64)] = False

    def retain(self, alive: np.ndarray) -> None:
        """Close every mapped block not in ``alive`` (the node's window at this step); none when
        the window holds every block (``release``)."""
        self._check_pid()
        if self._arena is not None:
            self._arena.retain(alive)
            return
        if self._keeps_all or alive is self._retained:
            return
        for block in self._outside(_HELD, alive).tolist():
            self._close(block)
        self._retained = alive

    def release(self, done: np.ndarray, keep: np.ndarray | None = None) -> None:
        """After a batch: close the blocks of ``done`` (this rank has used them for the last time
        this epoch) and, in a DataLoader worker, every block outside ``keep`` (what the sampler
        says it may hold until its next batch; None: nothing, the sampler was not told of the
        workers). A window that holds every block keeps them mapped for the next epoch instead
        (as global mode keeps its segment: nothing else of this stream will need their room, and
        mapping them again each epoch is most of an epoch's cost)."""
        self._check_pid()
        if self._arena is not None:
            self._arena.release(done, keep)
            return
        if self._keeps_all:
            return
        for block in np.asarray(done).tolist():
            self._close(int(block))
        if keep is None and get_worker_info() is None:
            return  # the rank gathers its own batches: it keeps what its window holds
        for block in self._outside(_HELD, np.zeros(0, dtype=np.int64) if keep is None else keep).tolist():
            self._close(block)

    def _close(self, block: int) -> None:
        self._prefetched = None  # the block may be asked for again
        if self._stitched is not None:
            self._stitched.remove(block)
        if self._state[block] == _HELD:
            self._state[block] = _NONE
        for segment in self._held.pop(block, []):
            segment.close()

    def prefetch(self, ahead: np.ndarray, alive: np.ndarray) -> None:
        """Ask for the blocks of ``alive``, then ``ahead``, not mapped or asked for yet, without waiting: the
        daemon starts their loads. At most PREFETCH_DEPTH blocks are asked for and not mapped at a
        time; a full budget, shm filesystem or load queue (CapacityError) stops the prefetch here
        (the blocks are asked for again when needed). Forgets the prefetches outside ``alive`` and
        ``ahead`` (the window has passed them: nothing held, nothing to close)."""
        self._check_pid()
        if self._arena is not None and self._wholes.asked:
            self._arena.prefetch(ahead, alive)
            return
        if (self._keeps_all and not self._asked and len(self._held) == self.layout.n_blocks
                and self._wholes.asked):
            return  # every block mapped and kept: nothing to ask for, each batch (a second epoch's)
        if self._prefetched is not None and self._prefetched[0] is ahead and self._prefetched[1] is alive:
            return  # this window's blocks all asked for or mapped already
        said = (ahead, alive)
        alive = np.asarray(alive, dtype=np.int64)
        ahead = np.asarray(ahead, dtype=np.int64)[:PREFETCH_DEPTH]  # further ahead is never asked for
        for block in self._outside(_ASKED, ahead, alive).tolist():
            del self._asked[block]
            self._state[block] = _NONE
        client = self.client()
        self._wholes.start(client)  # the keys held whole: their loads start now
        if self._arena is not None:
            self._arena.prefetch(ahead, alive)
            return
        # the window's own blocks first: at the start of an epoch (or a resume) none is asked
        # for yet, and the daemon starts loads in the order asked; the blocks ahead are asked as
        # prefetches, which the daemon refuses rather than evict another rank's next block for
        wanted: list[tuple[int, bool]] = []  # (block, prefetch)
        for prefetch, blocks in ((False, alive), (True, ahead)):
            for block in blocks[self._state[blocks] == _NONE].tolist():
                if len(self._asked) + len(wanted) >= PREFETCH_DEPTH:
                    break
                if (block, False) not in wanted and (block, True) not in wanted:  # listed twice
                    wanted.append((block, prefetch))
        if not wanted:
            self._prefetched = said if len(self._asked) < PREFETCH_DEPTH else None
            return
        per_block = [self._requests(block, prefetch) for block, prefetch in wanted]
        # sent together, their replies taken together: one wait, not a round trip a block and key
        replies = iter(client.request_many([r for requests in per_block for r in requests]))
        for (block, _), requests in zip(wanted, per_block):
            answers = [next(replies) for _ in requests]
            refused = next((a for a in answers if isinstance(a, Exception)), None)
            if isinstance(refused, CapacityError):
                return  # a full budget, shm filesystem or load queue: the rest are asked for again when needed
            if refused is not None:
                raise refused
            self._asked[block] = [AcquireResult.from_wire(a) for a in answers if not isinstance(a, Exception)]
            self._state[block] = _ASKED
        self._prefetched = said if len(self._asked) < PREFETCH_DEPTH else None

    # ----- gathering --------------------------------------------------------------------------
    def _block(self, block: int, needed: set[int]) -> list[AttachedSegment]:
        segments = self._held.get(block)
        if segments is not None:
            self._held.move_to_end(block)
            return segments
        while len(self._held) >= self.mapped_cap:  # no hint freed room (plain indices): the LRU block goes
            victim = next((b for b in self._held if b not in needed), None)
            if victim is None:
                break  # one batch spans more blocks than the window: map them, the daemon's budget decides
            self._close(victim)
        requests = self._requests(block)
        asked = self._asked.pop(block, None)
        self._state[block] = _NONE
        answers: list[AcquireResult | None] = [None] * len(requests) if asked is None else list(asked)
        # its keys mapped so far, which a wait for room for the next one lets go too (``_let_go``):
        # mapped again then
        partial: list[AttachedSegment | None] = [None] * len(requests)
        self._partial = partial
        try:
            while None in partial:
                i = partial.index(None)
                partial[i], answers[i] = self._attach(requests[i], answers[i], block), None
        except BaseException:
            for segment in partial:
                if segment is not None:
                    segment.close()
            raise
        finally:
            self._partial = []
        segments = [segment for segment in partial if segment is not None]
        if self._stitched is not None:
            try:
                self._stitched.place(block, segments)
            finally:
                # placed, a slot's mapping holds the file (and with it the lease): no descriptor
                # per block, so a window of many blocks never reaches the descriptor limit
                for segment in segments:
                    segment.close()
        self._held[block] = segments
        self._state[block] = _HELD
        self.attaches += 1
        self.peak = max(self.peak, len(self._held))
        return segments

    def _attach(self, request: Acquire, result: AcquireResult | None, block: int) -> AttachedSegment:
        """``block``'s segment of ``request``'s key, mapped (``result``: the daemon's last answer, if any).

        Raised when it stays unmappable for ``wait_s`` (evicted each time between the answer and
        the mapping): SegmentError; as ``_wait_ready`` is."""
        # evicted between the answer and the mapping (a block nobody held yet, its room taken for
        # another process's block: many workers short of room): asked again until wait_s
        client = self.client()
        segment, result = attach_asking_again(client, result, lambda: self._wait_ready(client, request, block),
                                              EvictionRetry(deadline=time.monotonic() + self.wait_s))
        m = segment.meta
        assert request.rows is not None
        if m.key != request.key or m.row_range.span != request.rows or m.row_range.step != 1:
            segment.close()
            raise SegmentError(f"segment {result.name} does not hold rows [{request.rows[0]}, {request.rows[1]}) "
                               f"of {request.key!r} (stream block {block})")
        return segment

    def _wait_ready(self, client: DaemonClient, request: Acquire, block: int | None) -> AcquireResult:
        """The block's segment (``block`` None: a key held whole), loaded: waits for the load,
        and for room while there is none, up to ``wait_s``: in the daemon's budget while other
        ranks or jobs hold it full (BudgetExceeded), in its shm filesystem while other files
        fill it (ShmFull: the daemon keeps a failed load's error for a few seconds, then loads
        it again when asked), or in its load queue while this user's loads fill it (CapacityError).

        Raised when there is no room by then: the same class, naming the block, the window, the
        budget and the blocks this process holds."""
        started = time.monotonic()
        deadline = started + self.wait_s
        pause = _FIRST_BACKOFF_S
        self.ready_waits += 1
        while True:
            try:
                result = client.acquire(request, None, None if self.spec.timeout is None else deadline)
                self.waited_s += time.monotonic() - started
                return result
            except CapacityError as exc:
                if time.monotonic() + pause > deadline:
                    raise self._no_room.error(request, block, list(self._held), exc) from exc
                self._let_go()
                self.budget_waits += 1
                time.sleep(pause)
                pause = min(2 * pause, _MAX_BACKOFF_S)

    def _waited_for_room(self) -> None:
        self.budget_waits += 1

    def _let_go(self) -> None:
        """Close every block mapped, and the keys of the block being mapped (``_block`` maps them
        again): a rank that waits for room holds nothing meanwhile. Ranks apart by a few steps
        each held their own window's blocks, together the whole budget, and each waited for the
        other's (a job without a collective per step, or workers running ahead). The blocks stay
        loaded unless another rank needs the room; a later batch maps them again."""
        if not self._held and not any(s is not None for s in self._partial):
            return
        self.yields += 1
        for held in list(self._held):
            self._close(held)
        for i, segment in enumerate(self._partial):
            if segment is not None:
                segment.close()
                self._partial[i] = None

    def gather(self, rows: np.ndarray) -> list[torch.Tensor | np.ndarray | RaggedColumn]:
        """The rows ``rows`` (global, int64) of every dataset, mapping the blocks that hold them
        (and the keys held whole).

        Raised when a block finds no room in time: BudgetExceeded; when the daemon fails to
        load one: its error class."""
        self._check_pid()
        streamed = (self._gather_arena(rows) if self._arena is not None
                    else self._gather_stitched(rows) if self._stitched is not None else gather_by_block(
            rows, self.layout, *self._streamed, lambda block, needed: [_arrays(s) for s in self._block(block, needed)]))
        if len(streamed) == len(self.infos):
            return streamed
        columns: list[torch.Tensor | np.ndarray | RaggedColumn] = []
        parts = iter(streamed)
        for index, whole in enumerate(self.whole):
            if not whole:
                columns.append(next(parts))
                continue
            columns.append(self._wholes.column(index, rows, self.client(),
                                               lambda client, request: self._wait_ready(client, request, None),
                                               self.wait_s))
        return columns

    def _gather_stitched(self, rows: np.ndarray) -> list[torch.Tensor | np.ndarray | RaggedColumn]:
        """The streamed keys' rows ``rows``: the blocks not placed yet mapped (``_block``), then
        one gather per key across every block (stitched.py)."""
        assert self._stitched is not None
        stitched = self._stitched
        ids = self.layout.block_of(rows)
        missing = stitched.missing(ids)
        parts = None
        if len(missing):
            needed = set(np.unique(ids).tolist())
            for block in missing.tolist():
                self._block(int(block), needed)
            if len(stitched.missing(ids)):  # it waited for room and let this batch's blocks go meanwhile
                parts = stitched.gather_each(ids, rows, lambda block: self._block(block, needed))
        return self._columns(parts or stitched.gather(ids, rows))

    def _gather_arena(self, rows: np.ndarray) -> list[torch.Tensor | np.ndarray | RaggedColumn]:
        assert self._arena is not None
        return self._columns(self._arena.gather(rows))

    def _columns(self, parts: list[np.ndarray]) -> list[torch.Tensor | np.ndarray | RaggedColumn]:
        columns: list[torch.Tensor | np.ndarray | RaggedColumn] = []
        for taken, info, wanted in zip(parts, *self._streamed):
            taken = taken if taken.dtype == info.dtype else taken.astype(info.dtype)  # as gather_by_block casts
            columns.append(as_column(taken if taken.dtype == wanted else taken.astype(wanted)))
        return columns

    def close(self) -> None:
        if self._arena is not None:
            self._arena.close()
        if self._stitched is not None and self._pid == os.getpid():
            for block in list(self._held):
                self._close(block)
            self._stitched.close()
        if self._pid == os.getpid():
            for block in list(self._held):
                self._close(block)
            self._wholes.close()
            if self._client is not None:
                self._client.close()
        self._reset()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        # a spawned worker maps its own
        state.update(_pid=-1, _client=None, _held=OrderedDict(), _asked={}, _stitched=None, _arena=None, _partial=[],
                     _wholes=WholeKeys(self.spec, self.whole, self.out_dtypes), _retained=None, _prefetched=None)
        return state


def _arrays(segment: AttachedSegment) -> Arrays:
    """A block segment's rows as gather_by_block takes them (variable-length: offsets and values).

    Raised when a variable-length segment has no values part: SegmentError."""
    if not segment.meta.vlen:
        return segment.data
    if segment.values is None:
        raise SegmentError(f"segment {segment.path} holds variable-length rows without their values: it is damaged; "
                           "the daemon loads it again once it is removed")
    return segment.data, segment.values
