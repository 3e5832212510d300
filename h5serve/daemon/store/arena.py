"""The daemon's stream arenas (docs/architecture.md, *Stream arena*):
a stream block of fixed-size rows asked for with ``Acquire.arena`` (its key's rows a slot)
goes into a slot of one arena file per (source identity, key, dtype, rows a slot), not into a
segment of its own (segments/arena.py has the layout and the leases).

A slot is taken for a block at its first acquire: a slot never used yet while the budget has
room for it (``make_room``: the store's eviction of other segments; an arena's slots are counted
from their first use, ``nbytes``), else the least recently used ready slot the daemon can take a
write lock on without waiting (no rank holds a read lock on it: nobody reads it), a prefetch
only a slot some request needed since it was loaded (never another rank's next block). The write
lock is held while a loader rewrites the slot and dropped after the table says (block,
generation, READY). Everything here runs on the control loop's thread; loads go to the store's
loader pool as jobs with ``LoadJob.arena``.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import secrets
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerProcess
from pathlib import Path
from typing import Protocol

import numpy as np

from ...errors import BudgetExceeded, ProtocolError, SegmentError, error_from_code
from ...segments import SegmentMeta, segment_prefix
from ...segments.arena import (
    ARENA_MARK,
    FREE,
    LOADING,
    READY,
    ArenaLayout,
    ArenaTarget,
    lock_range,
    locked_by_others,
    punch_hole,
    table_of,
    write_header,
)
from ...util.units import format_bytes, row_nbytes
from ...wire.protocol import Acquire, AcquireResult
from ..config import ARENA_GRACE_S, ARENA_SWEEP_S, DEFAULT_STALL_TIMEOUT_S, FAILURE_MEMORY_S
from ..loading.killload import kill_load
from ..loading.loader import LoadError, LoadJob, LoadOk
from ..loading.loaderpool import LoaderPool
from .loadindex import LoadIndex
from .loadqueue import check_queue_of
from .refusals import over_budget, stalled_load

__all__ = ["ArenaHost", "Arenas"]

log = logging.getLogger("h5serve.daemon")


class ArenaHost(Protocol):
    """What the arenas use of the store (store.py's SegmentStore): its eviction, its loads (the
    loaders and the per-uid queue bound count slot loads with them) and its budget's accounts."""

    budget_rule: str
    counters: Counter[str]
    loads: LoadIndex

    def used_bytes(self) -> int: ...

    def make_room(self, needed: int, meta: SegmentMeta, prefetch: bool = False, arena: object = None,
                  punch: bool = True) -> None: ...


@dataclass
class _Slot:
    index: int
    block: int = -1  # start row of the block it holds
    generation: int = 0
    state: int = FREE
    needed: bool = False  # a request that was no prefetch asked for its block since it was loaded
    punched: bool = False  # its pages given back (free, not counted in the budget)
    meta: SegmentMeta | None = None
    spans: tuple[tuple[int, int], ...] | None = None
    uid: int = 0
    process: ForkServerProcess | None = None
    reply: Connection | None = None
    started: float = 0.0  # its load's start (the stall watchdog's clock)


@dataclass
class _Arena:
    name: str
    fd: int
    ino: int
    layout: ArenaLayout
    table: np.ndarray
    mapping: mmap.mmap
    slots: list[_Slot] = field(default_factory=list)  # the slots used so far (grown one at a time)
    slot_of: dict[int, int] = field(default_factory=dict)  # block start row -> slot
    failures: dict[int, tuple[str, str, float]] = field(default_factory=dict)  # block start -> code, message, when
    asked: float = field(default_factory=time.monotonic)  # its last acquire (``sweep``'s grace counts from it)
    serial: int = 0  # its number in ``Arenas._lru``'s keys
    # kept as slots change, so that no step looks at every slot (150,000 of them in a large window)
    used: int = 0  # slots with their pages (counted in the budget)
    free: list[int] = field(default_factory=list)  # FREE slots that have their pages
    holes: list[int] = field(default_factory=list)  # punched slots (FREE, no pages)
    loading: int = 0  # slots LOADING (queued or running)

    @property
    def nbytes(self) -> int:
        return self.layout.data_offset + self.used * self.layout.slot_bytes

    def publish(self, slot: _Slot) -> None:
        """The table's row for ``slot``: its block and generation first, its state last."""
        self.table[slot.index, 0] = slot.block
        self.table[slot.index, 1] = slot.generation
        self.table[slot.index, 2] = slot.state


class Arenas:
    """Every arena of one daemon in ``shm_dir`` (files under its prefix, so shutdown and the next
    daemon's leftovers remove them); ``max_memory``: the budget their used slots count against."""

    def __init__(self, shm_dir: Path, namespace: str, group: int | None, max_memory: int, max_loaders: int,
                 pool: LoaderPool, host: ArenaHost, offered: bool = False,
                 stall_timeout: float = DEFAULT_STALL_TIMEOUT_S) -> None:
        self.offered = offered  # its ping says so; else Acquire.arena is refused (H5SERVE_ARENA=0, or --group)
        self.shm_dir, self.namespace, self.group = shm_dir, namespace, group
        self.max_memory, self.max_loaders, self.pool = max_memory, max_loaders, pool
        self.stall_timeout = stall_timeout  # a slot load running this long is stopped (--stall-timeout)
        self._host = host
        self._next_sweep = 0.0
        self.removed = 0  # arenas unlinked: no stream used them any more
        self.kept = 0  # sweeps that kept an arena past its grace because a process had it open or leased
        self._arenas: dict[tuple, _Arena] = {}
        self._by_serial: dict[int, _Arena] = {}
        # every arena's READY slots, least recently asked for first: (arena serial, slot index)
        self._lru: OrderedDict[tuple[int, int], None] = OrderedDict()
        self._serials = 0
        self._queue: list[tuple[_Arena, _Slot]] = []
        self._turn = False  # take_turn: the slot loads' turn at the next loader freed
        self._running: list[tuple[_Arena, _Slot]] = []
        self._reaping: list[ForkServerProcess] = []
        self.loads = 0
        self.reclaims = 0
        self.punches = 0

    @property
    def nbytes(self) -> int:
        """What the budget counts of the arenas: their headers and every slot used so far."""
        return sum(a.nbytes for a in self._arenas.values())

    # ----- acquire --------------------------------------------------------------------------
    def acquire(self, req: Acquire, meta: SegmentMeta, spans: tuple[tuple[int, int], ...] | None,
                uid: int) -> AcquireResult:
        """``req``'s block in a slot: ready, or loading (its load queued).

        Raised when no slot can be had (the budget full, every slot leased): BudgetExceeded; when
        the block's last load failed moments ago: its error. Raised when this daemon offers no
        arenas (a client asks only when its ping says it does): ProtocolError."""
        assert req.rows is not None
        if not self.offered:
            raise ProtocolError("this daemon offers no stream arenas (started with H5SERVE_ARENA=0, or shared with "
                                "--group; its ping says so): ask for the block without 'arena'")
        arena = self._arena_of(req, meta)
        start = req.rows[0]
        failed = arena.failures.get(start)
        if failed is not None:
            if time.monotonic() - failed[2] < FAILURE_MEMORY_S:
                raise error_from_code(failed[0], failed[1])
            del arena.failures[start]
        arena.asked = time.monotonic()
        index = arena.slot_of.get(start)
        if index is None:
            # one more load queued for ``uid``: counted with its segments' (loadqueue.py), as a segment's load is
            check_queue_of(self._host.loads.queued(), uid, meta, self._host.counters, self.queued_by(uid))
            slot = self._take_slot(arena, meta, req.prefetch)
            slot.block, slot.generation, slot.state, slot.needed = start, slot.generation + 1, LOADING, False
            arena.loading += 1
            slot.meta, slot.spans, slot.uid = meta, spans, uid
            arena.publish(slot)
            arena.slot_of[start] = slot.index
            self._queue.append((arena, slot))
        else:
            slot = arena.slots[index]
            if slot.state == READY:
                self._lru.move_to_end((arena.serial, index))
        slot.needed = slot.needed or not req.prefetch
        st = os.fstat(arena.fd)
        dir_st = os.stat(self.shm_dir)
        state = "ready" if slot.state == READY else "loading"
        return AcquireResult(state, arena.name, str(self.shm_dir), meta.rows if state == "ready" else 0, meta.rows,
                             meta.total_rows, os.getuid(), dir_st.st_dev, dir_st.st_ino, st.st_ino, 0,
                             slot.index, slot.generation)

    def _arena_of(self, req: Acquire, meta: SegmentMeta) -> _Arena:
        key = (meta.source, meta.key, meta.dtype, req.arena)
        arena = self._arenas.get(key)
        if arena is not None:
            return arena
        row_bytes = row_nbytes(meta.row_shape, meta.np_dtype)
        layout = ArenaLayout(1, req.arena, row_bytes, meta.dtype, tuple(meta.row_shape))
        blocks = -(-meta.total_rows // req.arena)
        layout = ArenaLayout(max(1, min(blocks, self.max_memory // layout.slot_bytes)), req.arena, row_bytes,
                             meta.dtype, tuple(meta.row_shape))
        name = f"{segment_prefix(self.namespace)}{ARENA_MARK}{secrets.token_hex(16)}"
        dir_fd = os.open(self.shm_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            # the daemon's user's alone: arenas are offered only by a daemon no other user may use
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        try:
            os.ftruncate(fd, layout.file_size)  # sparse: tmpfs gives a slot its pages when it is written
            write_header(fd, layout)
            mapping = mmap.mmap(fd, layout.data_offset, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(self.shm_dir / name)
            raise
        self._serials += 1
        arena = _Arena(name, fd, os.fstat(fd).st_ino, layout, table_of(mapping, layout), mapping,
                       serial=self._serials)
        self._arenas[key] = arena
        self._by_serial[arena.serial] = arena
        log.info("stream arena %s for %s[%s]: %d slots of %d rows (%s each)", name, meta.source_path, meta.key,
                 layout.n_slots, req.arena, format_bytes(layout.slot_bytes))
        return arena

    def _take_slot(self, arena: _Arena, meta: SegmentMeta, prefetch: bool) -> _Slot:
        """A slot for a new block, write-locked by this daemon, the first of: a free slot that
        has its pages; one more slot's pages while the budget has room (unheld segments evicted
        for it as for any load); then, least recently used first over every arena's ready slots
        nobody leases (for a prefetch, only those some request needed since their load): one of
        this arena's, reused, or another arena's, punched to grow this one. So arenas share the
        budget as segments per block did (LRU), a finished stream's arena gives way, and a
        prefetch never takes another rank's next block."""
        layout = arena.layout
        refusals = self._host.counters["refusals"]  # a refusal of the store's eviction below is this one's
        # a free slot's lock fails only while a rank that locked it before reading the table lets go
        if arena.free and self._lock(arena, arena.slots[arena.free[-1]]):
            return arena.slots[arena.free.pop()]
        grown = self._grow(arena, meta, prefetch)
        if grown is not None:
            return grown
        can_grow = len(arena.slots) < layout.n_slots or bool(arena.holes)
        while True:
            found = self._unleased(arena, can_grow, prefetch)
            if found is None:
                break
            owner, slot = found
            del self._lru[(owner.serial, slot.index)]
            if owner is arena:
                del arena.slot_of[slot.block]
                self.reclaims += 1
                return slot
            self._punch_locked(owner, slot)
            grown = self._grow(arena, meta, prefetch)
            if grown is not None:
                return grown
        # no slot to be had: the store's refusal of a segment that does not fit (refusals.over_budget),
        # counted once, the same error a block in a segment of its own meets
        if self._host.counters["refusals"] == refusals:
            self._host.counters["refusals"] += not prefetch
        raise over_budget(meta, layout.slot_bytes, self._host.used_bytes(), self.max_memory, self._host.budget_rule)

    def _unleased(self, arena: _Arena, can_grow: bool, prefetch: bool) -> tuple[_Arena, _Slot] | None:
        """The least recently asked for READY slot nobody leases, write-locked: one of ``arena``'s,
        or (``can_grow``) another arena's; for a prefetch only one some request needed since its
        load. The slots looked at before it are the leased ones asked for longer ago (mostly
        blocks being read now), not every slot."""
        for serial, index in self._lru:
            owner = self._by_serial[serial]
            slot = owner.slots[index]
            if (owner is arena or can_grow) and (slot.needed or not prefetch) and self._lock(owner, slot):
                return owner, slot
        return None

    def _grow(self, arena: _Arena, meta: SegmentMeta, prefetch: bool) -> _Slot | None:
        """One more slot's pages (a punched slot's, or a slot never used), write-locked, if the
        budget has room for them (unheld segments evicted for it; no arena's slot punched)."""
        if not arena.holes and len(arena.slots) >= arena.layout.n_slots:
            return None
        try:
            self._host.make_room(arena.layout.slot_bytes, meta, prefetch, arena, False)
        except BudgetExceeded:
            return None
        if arena.holes:
            slot = arena.slots[arena.holes.pop()]
        else:
            slot = _Slot(len(arena.slots))
            arena.slots.append(slot)
        slot.punched = False
        arena.used += 1
        if not self._lock(arena, slot):  # a rank between its lock and its look at the table: free, with pages
            slot.state = FREE
            arena.free.append(slot.index)
            return None
        return slot

    @staticmethod
    def _lock(arena: _Arena, slot: _Slot) -> bool:
        return lock_range(arena.fd, arena.layout.slot_offset(slot.index), arena.layout.slot_bytes, fcntl.F_WRLCK)

    def punch(self, needed: int, keep: object = None) -> int:
        """Give back the pages of ready slots nobody leases, least recently used first, until
        ``needed`` bytes are freed: the store's eviction when another load needs the room
        (never ``keep``'s slots). Returns the bytes freed."""
        freed = 0
        for serial, index in list(self._lru):
            if freed >= needed:
                break
            arena = self._by_serial[serial]
            slot = arena.slots[index]
            if arena is not keep and self._lock(arena, slot):
                del self._lru[(serial, index)]
                self._punch_locked(arena, slot)
                freed += arena.layout.slot_bytes
        return freed

    def _punch_locked(self, arena: _Arena, slot: _Slot) -> None:
        """Free ``slot``, which this daemon write-locked (out of ``_lru``), and give back its pages."""
        offset, size = arena.layout.slot_offset(slot.index), arena.layout.slot_bytes
        arena.slot_of.pop(slot.block, None)
        slot.state, slot.block, slot.punched = FREE, -1, True
        arena.publish(slot)
        punch_hole(arena.fd, offset, size)
        lock_range(arena.fd, offset, size, fcntl.F_UNLCK)
        arena.used -= 1
        arena.holes.append(slot.index)
        self.punches += 1

    # ----- loads ----------------------------------------------------------------------------
    def launch(self) -> None:
        """Start queued slot loads while loaders are free (the store's running loads count too)."""
        while self._queue and len(self._running) + len(self._host.loads.running()) < self.max_loaders:
            self._start()

    def take_turn(self) -> bool:
        """Start the oldest queued slot load if it is the slot loads' turn: every other loader the
        store starts while segment loads wait too. The store started its own queue first, so a
        queue kept full of one user's segment loads left a slot load queued until that stopped
        (a stream's needed block waited out its timeout). Whether one was started."""
        self._turn = not self._turn
        if not (self._turn and self._queue):
            return False
        self._start()
        return True

    def _start(self) -> None:
        arena, slot = self._queue.pop(0)
        assert slot.meta is not None
        layout = arena.layout
        target = ArenaTarget(arena.name, arena.ino, layout.slot_offset(slot.index), slot.meta.rows * layout.row_bytes)
        job = LoadJob(self.shm_dir, "", "", slot.meta, self.group, os.getpid(), 1, False, False, slot.spans,
                      keep=True, virtual_ok=slot.uid in (os.geteuid(), 0), arena=target)
        slot.process, slot.reply = self.pool.launch(job)
        slot.started = time.monotonic()
        self._running.append((arena, slot))

    def poll(self) -> None:
        """Reap finished slot loads: publish (the table, then the write lock dropped) or free the slot."""
        still = []
        now = time.monotonic()
        for arena, slot in self._running:
            assert slot.process is not None and slot.reply is not None
            alive = slot.process.is_alive()
            result: object = None
            if slot.reply.poll():
                try:
                    result = slot.reply.recv()
                except (EOFError, OSError):
                    result = None
            elif alive and now - slot.started < self.stall_timeout:
                still.append((arena, slot))
                continue
            elif alive:
                result = self._stop_stalled(arena, slot, now)
            if isinstance(result, LoadOk) and self.pool.finished(slot.process):
                self.pool.loaded()
            else:
                self.pool.forget(slot.process)
                slot.reply.close()
                self.pool.loaded()
                self._reaping.append(slot.process)
            slot.process, slot.reply = None, None
            arena.loading -= 1
            if isinstance(result, LoadOk):
                slot.state = READY
                self._lru[(arena.serial, slot.index)] = None
                self.loads += 1
            else:
                code, message = ((result.code, result.message) if isinstance(result, LoadError)
                                 else (SegmentError.code, "the loader process died; see the daemon log"))
                log.warning("stream arena %s slot %d: the load failed: %s", arena.name, slot.index, message)
                arena.failures[slot.block] = (code, message, time.monotonic())
                arena.slot_of.pop(slot.block, None)
                slot.state, slot.block = FREE, -1
                arena.free.append(slot.index)
            arena.publish(slot)
            lock_range(arena.fd, arena.layout.slot_offset(slot.index), arena.layout.slot_bytes, fcntl.F_UNLCK)
        self._running = still
        self._reaping = [p for p in self._reaping if not _reaped(p)]
        self.sweep()

    def _stop_stalled(self, arena: _Arena, slot: _Slot, now: float) -> LoadError:
        """Kill a slot load that ran ``stall_timeout`` (a stopped loader, a hung file system): its
        failure, which ``poll`` answers for FAILURE_MEMORY_S as a segment load's."""
        assert slot.process is not None and slot.process.pid is not None and slot.meta is not None
        killed = kill_load(slot.process.pid)
        self._host.counters["stalled"] += 1
        log.warning("stream arena %s slot %d: the load of rows %d-%d made no progress for %.0fs: killed its %d "
                    "process(es)", arena.name, slot.index, slot.block, slot.block + slot.meta.rows - 1,
                    now - slot.started, killed)
        return LoadError(SegmentError.code, stalled_load(slot.meta, 0, self.stall_timeout))

    def queued_by(self, uid: int) -> int:
        """Slot loads ``uid`` asked for that wait for a loader (its per-uid queue bound counts them)."""
        return sum(1 for _, slot in self._queue if slot.uid == uid)

    def sweep(self) -> None:
        """Unlink every arena no stream uses any more, and with it every page it held, its header
        and table too: no process has it open (each holds a read lock on the header page while
        it does: ``ArenaBlocks``' ``_Mapped``), none leases a slot, no slot is loading, and none
        was asked for in ARENA_GRACE_S (between an answer and its client's open). Runs from
        ``poll`` at most every ARENA_SWEEP_S."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + ARENA_SWEEP_S
        for key, arena in list(self._arenas.items()):
            if now - arena.asked < ARENA_GRACE_S or arena.loading:
                continue
            if locked_by_others(arena.fd, 0, arena.layout.file_size):
                self.kept += 1
                continue
            log.info("stream arena %s: no stream uses it any more, removed (%s given back)", arena.name,
                     format_bytes(arena.nbytes))
            del self._arenas[key], self._by_serial[arena.serial]
            for slot in arena.slots:
                self._lru.pop((arena.serial, slot.index), None)
            self._queue = [(a, s) for a, s in self._queue if a is not arena]
            self._close_arena(arena)
            try:
                os.unlink(self.shm_dir / arena.name)
            except FileNotFoundError:
                pass
            self.removed += 1

    @staticmethod
    def _close_arena(arena: _Arena) -> None:
        del arena.table
        arena.mapping.close()
        os.close(arena.fd)

    def report(self) -> dict[str, int]:
        """Counters and sizes for ``status``."""
        slots = [s for a in self._arenas.values() for s in a.slots]
        return {"arenas": len(self._arenas), "loads": self.loads, "reclaims": self.reclaims, "punches": self.punches,
                "slots": len(slots), "ready": sum(s.state == READY for s in slots), "bytes": self.nbytes,
                "removed": self.removed, "kept": self.kept}

    def leased(self) -> bool:
        """Whether a process has any arena open or leases a slot of one (the idle exit waits for
        them as for a segment's lease): one ``F_OFD_GETLK`` an arena, over the whole file."""
        return any(locked_by_others(a.fd, 0, a.layout.file_size) for a in self._arenas.values())

    @property
    def running(self) -> int:
        """Slot loads running now (the store's loads count them against ``--loaders`` too)."""
        return len(self._running)

    def fds(self) -> list[int]:
        """The pipes of running slot loads (the control loop wakes on them)."""
        return [s.reply.fileno() for _, s in self._running if s.reply is not None and not s.reply.closed]

    def pending(self) -> bool:
        return bool(self._queue or self._running)

    def close(self) -> None:
        """Stop slot loads and close the arenas (the store's shutdown unlinks their files)."""
        for _, slot in self._running:
            if slot.process is not None:
                slot.process.kill()
                slot.process.join(timeout=5)
        self._running, self._queue = [], []
        for arena in self._arenas.values():
            self._close_arena(arena)
        self._arenas.clear()


def _reaped(process: ForkServerProcess) -> bool:
    if process.is_alive():
        return False
    process.close()
    return True
