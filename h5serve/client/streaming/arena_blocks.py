"""Stream mode's blocks of fixed-size rows from the daemon's arenas (unless
``H5SERVE_ARENA=0``; docs/architecture.md, *Stream arena*; segments/arena.py).

Each streamed key's arena is mapped once, whole, read-only; a block is *held* while this process
has an OFD read lock on its slot's range (taken, then the slot table checked to still show the
block and the generation the daemon answered with: else the lock is dropped and the block asked
for again). Releasing a block drops the lock and nothing else: no munmap, no mmap of the next
block. A batch is one ``take`` per key over the arena's rows, at slot-relative row numbers
(``slot * rows a slot + row - block start``), as ``stitched.py`` gathers without an arena.

One process only: a forked child's locks would be its parent's (one open file
description), so a child drops what it inherited without unlocking and opens its own.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import stat
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
from torch.utils.data import get_worker_info

from ...errors import CapacityError, SegmentError
from ...order.stream_order import BlockLayout
from ...segments.arena import READY, TABLE_OFFSET, ArenaLayout, lock_range, read_layout, table_of
from ...wire.connection import DaemonClient
from ...wire.protocol import Acquire, AcquireResult
from ...wire.runtime import ARENA_ENV, arena_wanted
from .refusal import NoRoom

__all__ = ["ArenaBlocks", "arenas_used"]

log = logging.getLogger("h5serve.client")


def arenas_used(eligible: bool, offered: bool) -> bool:
    """Whether a stream takes its blocks from the daemon's arenas: ``eligible`` (fixed-size rows,
    stitched, of one file), not turned off (``ARENA_ENV=0``) and ``offered`` by the daemon's
    ping. Not offered (an older daemon, one started with ``ARENA_ENV=0``, a shared one): a
    segment per block, said in the log, never an acquire the daemon would refuse."""
    if not (eligible and arena_wanted()):
        return False
    if not offered:
        log.info("h5serve: the daemon offers no stream arenas (older, shared, or %s=0): a segment per block",
                 ARENA_ENV)
    return offered

_FIRST_BACKOFF_S, _MAX_BACKOFF_S = 0.01, 0.5
_NONE, _ASKED, _HELD = 0, 1, 2
ASK_TOGETHER = 8  # blocks ahead asked for in one exchange (the window's own blocks are asked at once)


class _Mapped:
    """One arena, mapped whole and read-only, with its own open file description (its leases)."""

    def __init__(self, result: AcquireResult) -> None:
        path = Path(result.shm_dir) / result.name
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != result.uid or (result.ino and st.st_ino != result.ino):
                raise SegmentError(f"{path} is not the daemon's stream arena")
            self.layout: ArenaLayout = read_layout(os.pread(fd, 4096, 0))
            if st.st_size < self.layout.file_size:
                raise SegmentError(f"stream arena {path} is shorter than its header says")
            self._map = mmap.mmap(fd, self.layout.file_size, mmap.MAP_SHARED, mmap.PROT_READ)
            # in use while open: a read lock on the header page, which the daemon never locks;
            # with the last description that has one gone, and no lease, it removes the arena
            lock_range(fd, 0, TABLE_OFFSET, fcntl.F_RDLCK)
        except BaseException:
            os.close(fd)
            raise
        self.name, self.fd, self.pid = result.name, fd, os.getpid()
        # freed unclosed (a dataset collected, the process exiting): the descriptor closed, and with
        # it this description's leases; the mapping goes with the last view of it
        self._finalizer = weakref.finalize(self, _let_go, self._map, fd)
        lay = self.layout
        self.table = table_of(self._map, lay)
        dtype = np.dtype(lay.dtype)
        # the slots' rows as one axis when a slot is a whole number of rows (slot-relative rows),
        # else [slot, row] (two index arrays)
        self.per_slot = lay.slot_bytes // lay.row_bytes if lay.slot_bytes % lay.row_bytes == 0 else 0
        if self.per_slot:
            self.flat: np.ndarray | None = np.ndarray((lay.n_slots * self.per_slot, *lay.row_shape), dtype=dtype,
                                                      buffer=self._map, offset=lay.data_offset)
            self.view = None
        else:
            self.flat = None
            inner = tuple(int(s) for s in np.empty((1, *lay.row_shape), dtype=dtype).strides[1:])
            self.view = np.ndarray((lay.n_slots, lay.rows_per_slot, *lay.row_shape), dtype=dtype, buffer=self._map,
                                   offset=lay.data_offset, strides=(lay.slot_bytes, lay.row_bytes, *inner))

    def lock(self, slot: int, kind: int) -> bool:
        """Lease (``F_RDLCK``) or let go (``F_UNLCK``) of ``slot`` through this description.

        Raised in another process than the one that opened it (a forked child shares the open
        file description, so its unlock would drop its parent's lease): SegmentError."""
        if self.pid != os.getpid():
            raise SegmentError(f"stream arena {self.name} was opened by process {self.pid}: a forked process "
                               "opens its own (its own open file description, its own leases)")
        return lock_range(self.fd, self.layout.slot_offset(slot), self.layout.slot_bytes, kind)

    def shows(self, slot: int, start: int, generation: int) -> bool:
        row = self.table[slot]
        return int(row[0]) == start and int(row[1]) == generation and int(row[2]) == READY

    def take(self, slots: np.ndarray, local: np.ndarray) -> np.ndarray:
        if self.flat is not None:
            return self.flat.take(slots * self.per_slot + local, axis=0)
        assert self.view is not None
        return self.view[slots, local]

    def close(self) -> None:
        """Unmap and close. In a forked child this closes its copy of the descriptor only: the
        open file description, and its locks, stay the parent's while the parent holds it."""
        self.table = self.flat = self.view = None  # type: ignore[assignment]
        self._finalizer()


def _let_go(mapping: mmap.mmap, fd: int) -> None:
    try:
        mapping.close()
    except BufferError:  # a gathered view still alive: the mapping goes with it
        pass
    os.close(fd)


class ArenaBlocks:
    """The blocks of ``layout`` of ``keys`` streamed keys in the daemon's arenas, for one process.
    ``requests(block, prefetch)``: the acquires of a block, one per key (DaemonBlocks._requests);
    ``client()``: the process's DaemonClient; ``no_room``: how long a needed block waits for room
    and the words when it found none; ``keeps_all``: the window holds every block (kept);
    ``waited()``: called at each wait for room (DaemonBlocks.budget_waits)."""

    def __init__(self, layout: BlockLayout, keys: int, requests: Callable[[int, bool], list[Acquire]],
                 client: Callable[[], DaemonClient], no_room: NoRoom, depth: int, keeps_all: bool,
                 waited: Callable[[], None] = lambda: None) -> None:
        self.layout, self.keys, self._requests_of, self._client = layout, keys, requests, client
        self.no_room, self.wait_s, self._waited = no_room, no_room.wait_s, waited
        self.depth, self.keeps_all = depth, keeps_all
        self._pid = os.getpid()
        n = max(layout.n_blocks, 1)
        self._state = np.zeros(n, dtype=np.int8)
        self._slot = [np.full(n, -1, dtype=np.int64) for _ in range(keys)]
        self._leased: list[set[int]] = [set() for _ in range(keys)]  # per key: the slots this process leases
        self._arena: list[_Mapped | None] = [None] * keys
        self._asked: dict[int, list[AcquireResult]] = {}
        self._made: dict[tuple[int, bool], list[Acquire]] = {}
        # the window of the last prefetch (alive, ahead) and of the last retain, to skip repeats
        self._last_window: tuple[_Seen | None, _Seen | None] = (None, None)
        self._settled = False  # the last prefetch asked for all it wanted
        self._last_retained: _Seen | None = None
        self._held_since = -1  # ``holds`` at the last retain
        self.holds = 0  # blocks this process took leases on
        self.asked_again = 0  # leases that found the slot reused between the answer and the lock
        self.ready_waits = 0
        self.yields = 0  # times this process let every lease go while it waited for room
        self.exchanges = 0  # request_many calls (one wait each)

    def _requests(self, block: int, prefetch: bool) -> list[Acquire]:
        """The block's acquires, built once a process (checking a message costs more than sending it)."""
        found = self._made.get((block, prefetch))
        if found is None:
            found = self._made[(block, prefetch)] = [replace(r, arena=self.layout.block_rows)
                                                     for r in self._requests_of(block, prefetch)]
        return found

    # ----- the window -------------------------------------------------------------------------
    def _outside(self, state: int, *windows: np.ndarray) -> np.ndarray:
        inside = np.zeros(len(self._state), dtype=bool)
        for window in windows:
            inside[np.asarray(window, dtype=np.int64)] = True
        return np.flatnonzero((self._state == state) & ~inside)

    def retain(self, alive: np.ndarray) -> None:
        """Let go of the leases outside ``alive``; nothing to look at when the window is the one
        of the last call and nothing was leased since (most batches: a window changes only when
        a block enters or leaves it)."""
        self._check_pid()
        if self.keeps_all:
            return
        if self._held_since == self.holds and _same(self._last_retained, alive):
            return
        for block in self._outside(_HELD, alive).tolist():
            self._release(block)
        self._held_since, self._last_retained = self.holds, _seen(alive)

    def release(self, done: np.ndarray, keep: np.ndarray | None = None) -> None:
        """Let go of ``done`` and, in a DataLoader worker, of every lease outside ``keep``
        (DaemonBlocks.release: an idle worker holds nothing the batch its rank waits for lacks
        room for; None: nothing, the sampler was not told of the workers)."""
        self._check_pid()
        if self.keeps_all:
            return
        for block in np.asarray(done).tolist():
            self._release(int(block))
        if keep is None and get_worker_info() is None:
            return  # the rank gathers its own batches: it keeps what its window holds
        for block in self._outside(_HELD, np.zeros(0, dtype=np.int64) if keep is None else keep).tolist():
            self._release(block)

    def _release(self, block: int) -> None:
        if self._state[block] != _HELD:
            return
        for k in range(self.keys):
            slot = int(self._slot[k][block])
            arena = self._arena[k]
            if slot >= 0 and arena is not None:
                arena.lock(slot, fcntl.F_UNLCK)
            self._leased[k].discard(slot)
            self._slot[k][block] = -1
        self._state[block] = _NONE
        # its acquires, built once a process: kept only while it is in the window (an epoch of
        # 150,000 blocks kept them all, about a KiB a block)
        self._made.pop((block, False), None)
        self._made.pop((block, True), None)

    def prefetch(self, ahead: np.ndarray, alive: np.ndarray) -> None:
        """Ask for the window's blocks, then those ahead, not held or asked yet: one exchange."""
        self._check_pid()
        if self._settled and _same(self._last_window[0], alive) and _same(self._last_window[1], ahead):
            return  # the window of the last call, all of it asked for then
        self._last_window = (_seen(alive), _seen(ahead))
        alive = np.asarray(alive, dtype=np.int64)
        ahead = np.asarray(ahead, dtype=np.int64)[:self.depth]
        self._settled = False
        if self._asked:
            for block in self._outside(_ASKED, ahead, alive).tolist():
                del self._asked[block]
                self._state[block] = _NONE
        wanted: dict[int, bool] = {}
        for prefetch, blocks in ((False, alive), (True, ahead)):
            for block in blocks[self._state[blocks] == _NONE].tolist():
                if len(self._asked) + len(wanted) >= self.depth:
                    break
                wanted.setdefault(block, prefetch)
        # blocks ahead are asked for a few at a time (one exchange, not one a batch), the
        # window's own at once
        if all(wanted.values()) and len(wanted) < min(ASK_TOGETHER, len(ahead)):
            return
        self._settled = self._ask(wanted) and len(self._asked) < self.depth

    def _ask(self, wanted: dict[int, bool]) -> bool:
        """Ask for ``wanted`` (block: as a prefetch) in one exchange. False: the daemon refused
        one for room (the rest asked for again later)."""
        if not wanted:
            return True
        per_block = [self._requests(block, prefetch) for block, prefetch in wanted.items()]
        self.exchanges += 1
        replies = iter(self._client().request_many([r for requests in per_block for r in requests]))
        for block, requests in zip(wanted, per_block):
            answers = [next(replies) for _ in requests]
            refused = next((a for a in answers if isinstance(a, Exception)), None)
            if isinstance(refused, CapacityError):
                return False  # asked again when needed
            if refused is not None:
                raise refused
            self._asked[block] = [AcquireResult.from_wire(a) for a in answers if not isinstance(a, Exception)]
            self._state[block] = _ASKED
        return True

    # ----- holding a block --------------------------------------------------------------------
    def _hold(self, block: int) -> None:
        """Lease ``block``'s slot in every key's arena."""
        requests = self._requests(block, False)
        answers: list[AcquireResult | None] = list(self._asked.pop(block, [None] * len(requests)))
        start = int(self.layout.bounds[block])
        deadline = time.monotonic() + self.wait_s
        # a wait for room lets every lease go, this block's keys leased so far too: leased again
        while not all(self._slot[k][block] >= 0 for k in range(self.keys)):
            self._hold_keys(block, requests, answers, start, deadline)
            answers = [None] * len(requests)
        self._state[block] = _HELD
        self.holds += 1

    def _hold_keys(self, block: int, requests: list[Acquire], answers: list[AcquireResult | None], start: int,
                   deadline: float) -> None:
        for k, request in enumerate(requests):
            if self._slot[k][block] >= 0:
                continue
            result = answers[k]
            while True:
                if result is None or result.state != "ready":
                    result = self._ready(request, block, deadline)
                try:
                    arena = self._mapped(k, result)
                except FileNotFoundError:  # removed since the answer (no stream had it open): asked again
                    if time.monotonic() > deadline:
                        raise
                    result = None
                    continue
                if not 0 <= result.slot < arena.layout.n_slots:
                    raise SegmentError(f"the daemon answered slot {result.slot} of stream arena {result.name}, "
                                       f"which has {arena.layout.n_slots}")
                # a slot this process leases for another block: a stale answer (the block was there
                # before), and never unlocked here: one open file description has one lock a range, so
                # the unlock dropped the other block's lease and the daemon reused its slot under it
                mine = result.slot in self._leased[k]
                if not mine and arena.lock(result.slot, fcntl.F_RDLCK):
                    if arena.shows(result.slot, start, result.generation):
                        self._slot[k][block] = result.slot
                        self._leased[k].add(result.slot)
                        break
                    arena.lock(result.slot, fcntl.F_UNLCK)
                self.asked_again += 1  # reused (or being reused) since the answer: ask again
                result = None
                if time.monotonic() > deadline:
                    raise SegmentError(f"stream block {block} was reused each time before this rank could lease it "
                                       f"for {self.wait_s:g}s")

    def _mapped(self, key: int, result: AcquireResult) -> _Mapped:
        arena = self._arena[key]
        if arena is not None and arena.name == result.name:
            return arena
        if arena is not None:  # another arena (a daemon restarted): what was held of this key goes
            for block in np.flatnonzero(self._slot[key] >= 0).tolist():
                self._release(block)
            arena.close()
            self._slot[key][:] = -1  # a block's keys leased before it (not held yet) went with the arena
            self._leased[key].clear()
        arena = self._arena[key] = _Mapped(result)
        return arena

    def _ready(self, request: Acquire, block: int, deadline: float) -> AcquireResult:
        """The block loaded; no room for it (CapacityError: no slot in the budget, a full shm
        filesystem, a full load queue) waited out with backoff until ``deadline``, holding no
        lease meanwhile, as a segment per block lets go of every block it maps
        (DaemonBlocks._let_go): two ranks apart by a few steps never each wait for the other's.

        Raised when there is still no room by then: the same class, in refusal.py's words."""
        self.ready_waits += 1
        pause = _FIRST_BACKOFF_S
        while True:
            try:
                return self._client().acquire(request, None, deadline)
            except CapacityError as exc:
                held = np.flatnonzero(self._state == _HELD).tolist()
                if time.monotonic() + pause > deadline:
                    raise self.no_room.error(request, block, held, exc) from exc
                self._let_go()
                self._waited()
                time.sleep(pause)
                pause = min(2 * pause, _MAX_BACKOFF_S)

    def _let_go(self) -> None:
        """Drop every lease, the block being leased's keys too (``_hold`` leases them again)."""
        if not any((slots >= 0).any() for slots in self._slot):
            return
        self.yields += 1
        for block in np.flatnonzero(self._state == _HELD).tolist():
            self._release(block)
        for k, slots in enumerate(self._slot):  # a block's keys leased before the wait
            arena = self._arena[k]
            for block in np.flatnonzero(slots >= 0).tolist():
                if arena is not None:
                    arena.lock(int(slots[block]), fcntl.F_UNLCK)
                self._leased[k].discard(int(slots[block]))
                slots[block] = -1
        self._last_retained = None

    # ----- gathering ------------------------------------------------------------------------
    def gather(self, rows: np.ndarray) -> list[np.ndarray]:
        """Each streamed key's rows ``rows`` (global), leasing the blocks not held yet first."""
        self._check_pid()
        ids = self.layout.block_of(rows)
        local = rows - self.layout.bounds[ids]
        for _ in range(3):  # again only if leasing in a new arena (a daemon restarted) let some go
            absent = self._state[ids] != _HELD
            if not absent.any():
                break
            missing = np.unique(ids[absent])
            # one exchange for every block not answered ready yet (not a round trip each)
            stale = [b for b in missing.tolist()
                     if self._state[b] == _NONE or any(a.state != "ready" for a in self._asked[b])]
            for b in stale:
                self._asked.pop(b, None)
                self._state[b] = _NONE
            self._ask({b: False for b in stale})
            yields = self.yields
            for block in missing.tolist():
                if self._state[block] != _HELD:
                    self._hold(int(block))
            if self.yields != yields:  # it waited for room and let this batch's blocks go meanwhile
                return self._take_each(ids, local)
        return self._take(ids, local)

    def _take_each(self, ids: np.ndarray, local: np.ndarray) -> list[np.ndarray]:
        """The batch a block at a time, each leased then its rows copied: with room for one block
        beside what others hold, the next block's wait lets the last one go and takes its room."""
        out: list[np.ndarray] = []
        for block in np.unique(ids).tolist():
            if self._state[block] != _HELD:
                self._hold(int(block))
            mask = ids == block
            parts = self._take(ids[mask], local[mask])
            out = out or [np.empty((len(ids), *part.shape[1:]), dtype=part.dtype) for part in parts]
            for whole, part in zip(out, parts):
                whole[mask] = part
        return out

    def _take(self, ids: np.ndarray, local: np.ndarray) -> list[np.ndarray]:
        out = []
        for k in range(self.keys):
            arena = self._arena[k]
            slots = self._slot[k][ids]
            if arena is None or (len(slots) and int(slots.min()) < 0):
                raise SegmentError("a stream block was gathered before its slot was leased")
            out.append(arena.take(slots, local))
        return out

    def _check_pid(self) -> None:
        """In a forked child (a DataLoader worker), before anything else: what it inherited is
        its parent's (the arenas' open file descriptions, and so the parent's leases: an unlock
        here would drop them), so it is closed without a lock touched, and the child holds
        nothing; the arenas are opened anew at its first lease (its own descriptions and leases)."""
        if self._pid != os.getpid():
            self.close()
            self._pid = os.getpid()

    def close(self) -> None:
        if self._pid == os.getpid():
            for block in np.flatnonzero(self._state == _HELD).tolist():
                self._release(block)
        for arena in self._arena:
            if arena is not None:
                arena.close()
        self._arena = [None] * self.keys
        for slots, leased in zip(self._slot, self._leased):
            slots[:] = -1
            leased.clear()
        self._made.clear()
        self._asked.clear()
        self._state[:] = _NONE
        self._last_window, self._settled, self._last_retained = (None, None), False, None


_Seen = tuple[object, np.ndarray]  # a window as handed in, and a copy of its blocks


def _seen(now: np.ndarray) -> _Seen:
    return now, np.array(now, dtype=np.int64)


def _same(last: _Seen | None, now: np.ndarray) -> bool:
    """Whether ``now`` holds the blocks of ``last``: at once when it is the same object (the
    sampler hands the same arrays while a window does not change, and never changes one)."""
    return last is not None and (last[0] is now or (len(last[1]) == len(now) and bool(np.array_equal(last[1], now))))
