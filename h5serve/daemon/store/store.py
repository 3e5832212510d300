"""The daemon's registry of segments: single-flight loads, LRU eviction under a memory
budget, adoption of complete segments left by a previous daemon (leftovers.py), cleanup on
shutdown. Its records (``Entry``, ``LoadFailure``, the counters) are in entries.py.

Everything here runs on the control loop's thread; loads run in loader processes and are
reaped by ``poll_loads`` (reaping.py: publishing, failures, stalled loads).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ...errors import (
    AccessDenied,
    H5ServeError,
    SegmentError,
    error_from_code,
)
from ...hdf5.source import check_cast, resolve_dtype, storage_dtype
from ...order.sharding import STREAM, Selection
from ...segments import (
    UNKNOWN_STAMP,
    PublishStamp,
    SegmentMeta,
    check_published,
    header_checksum,
    read_progress,
    segment_name,
    temporary_name,
    try_evict,
)
from ...util.logtext import printable
from ...util.lru import LRU
from ...util.safeio import remove_if
from ...util.units import PAGE_BYTES, format_bytes
from ...wire.protocol import Acquire, AcquireResult
from ...wire.runtime import RuntimeLocation
from ..access.fdserver import Grant, grant, grants_of
from ..access.peer import Peer
from ..access.resolved import Resolved, ResolvedFiles
from ..access.resolver import RESOLVE_TIMEOUT_S, Resolver
from ..access.secret import load_secret
from ..access.urls import UrlPolicy
from ..config import (
    DEFAULT_STALL_TIMEOUT_S,
    FAILURE_MEMORY_S,
    MAX_AWAITING_RESOLUTION,
    MAX_REMEMBERED_METAS,
)
from ..loading.fileset import files_meta
from ..loading.loader import LoadJob, load_spans, loader_context
from ..loading.loaderpool import LoaderPool
from ..loading.vlenload import Room
from .arena import Arenas
from .entries import Entry, load_log_level, not_ours
from .leftovers import adopt_leftovers, own_files, publish_name
from .loadindex import Records
from .loadqueue import check_queue_of, next_queued, read_again_soon
from .prefetch import Prefetched
from .reaping import LoadReaper
from .refusals import over_budget
from .report import segments_status, visible_to
from .sweep import StaleSweep

__all__ = ["SegmentStore"]

log = logging.getLogger("h5serve.daemon")


class SegmentStore:
    secret: bytes  # segment names are keyed by it; recover() loads it before any request

    def __init__(
        self, location: RuntimeLocation, shm_dir: Path, max_memory: int, loaders: int,
        group: int | None = None, allow_roots: tuple[Path, ...] = (), budget_rule: str = "--max-memory",
        allow_urls: tuple[str, ...] = (),
        load_processes: int = 1, stall_timeout: float = DEFAULT_STALL_TIMEOUT_S, checksum: bool = True,
        drop_page_cache: bool = True, arenas: bool = False,
    ) -> None:
        self.budget_rule = budget_rule
        self.checksum = checksum  # loaders store a crc32 of the rows (status --verify compares it)
        self.drop_page_cache = drop_page_cache  # loaders drop the source's cached pages of the rows they read
        self.location = location
        self.shm_dir = shm_dir
        self.group = group
        self.allow_roots = tuple(os.path.realpath(r) for r in allow_roots)
        self.max_memory = max_memory
        self.max_loaders = loaders  # loads that run at once
        self.load_processes = max(1, load_processes)  # processes one load may be split across
        self.namespace = location.namespace
        # every segment by name, the failures pollers are told of, the counters, and the loads
        # among the segments as they are asked for and start (loadindex.py): never rebound
        self.records = Records()
        self.entries, self.failures = self.records.entries, self.records.failures
        self.counters, self.errors = self.records.counters, self.records.errors
        self.loads = self.records.loads
        self.resolver = Resolver(self.allow_roots, UrlPolicy.of(allow_urls, group))
        self._stale = StaleSweep()
        # the spare loader, and loaders kept between stream blocks (loaderpool.py)
        self.pool = LoaderPool(loader_context(), loaders)
        # the control loop's half of a running load: reaped, published, failed, stopped when stalled
        self.reaper = LoadReaper(self.records, self.pool, shm_dir, stall_timeout)
        self.prefetched = Prefetched()  # stream blocks loaded ahead of need, not needed yet (prefetch.py)
        # who may have which ready segment's descriptor: read by the hand-out thread, so never
        # changed in place, only replaced (``_grant``)
        self.grants: Mapping[str, Grant] = MappingProxyType({})
        self._last_uid = -1  # the uid whose queued load started last (round robin: loadqueue.next_queued)
        # requests answered before their file was resolved: their loads start once it is
        self._resolving: dict[tuple[Acquire, int, int], tuple[Acquire, Peer, float]] = {}
        self._answering = False  # loads asked for now start once the replies are sent (``answering``)
        # a request's segment and name while its file resolves alike (resolve.py's answer): a
        # stream job asks for every block and key again and again, and building the meta and
        # hashing its name was a third of answering a hit
        self._metas: LRU[tuple, tuple[Resolved | ResolvedFiles, SegmentMeta, str]] = LRU(MAX_REMEMBERED_METAS)
        # stream blocks asked for in slots of an arena (arena.py)
        self.arenas = Arenas(shm_dir, self.namespace, group, max_memory, loaders, self.pool, self, arenas,
                             stall_timeout)

    # ----- startup -------------------------------------------------------------------------
    def recover(self) -> None:
        """Load the naming secret; adopt what an earlier daemon on this runtime dir left
        (leftovers.py: complete segments whose sources are unchanged; the rest removed)."""
        self.secret = load_secret(self.location.directory)
        for entry in adopt_leftovers(self.shm_dir, self.namespace, self.secret):
            self.entries[entry.name] = entry
            self.counters["adopted"] += 1

    # ----- requests ------------------------------------------------------------------------
    def acquire(self, req: Acquire, peer: Peer) -> AcquireResult:
        """Find or start loading the segment for ``req``, asked by ``peer`` (access.requester).
        Never waits for a load; waits for the file's resolution only briefly (resolve.py) and
        answers "loading" meanwhile. A peer of another uid answered for a segment is granted
        it: it may have its descriptor (handout.py) and see it in ``status``.

        Raised when the file may not or cannot be served: AccessDenied, a DataError.
        """
        result = self._find_or_load(req, peer)
        if result.name:
            self._grant(result.name, peer.uid)
        return result

    def _awaiting_resolution(self, req: Acquire, peer: Peer) -> None:
        """Remember a request answered "loading" before its file was resolved, so that its load
        starts as soon as the resolution is done (``start_resolved``), not when (or if) its
        client asks again: a preload, or stream mode's prefetch, sends one acquire and moves on."""
        if len(self._resolving) >= MAX_AWAITING_RESOLUTION:
            self._resolving.pop(next(iter(self._resolving)))  # the oldest: its client asks again anyway
        self._resolving[(req, peer.uid, peer.gid)] = (req, peer, time.monotonic())

    def start_resolved(self) -> None:
        """Start the loads of requests whose resolution finished since they were answered (the
        control loop calls it when the resolver wakes it). The resolution stays for the
        client's next poll (which then finds the load running), errors included; nothing here
        counts as a hit."""
        now = time.monotonic()
        for key, (req, peer, since) in list(self._resolving.items()):
            resolved = self.resolver.peek(req.path, req.key, peer, req.files, req.pins or req.pin)
            if resolved is None and now - since <= RESOLVE_TIMEOUT_S:
                continue  # still resolving
            del self._resolving[key]
            if resolved is None or isinstance(resolved, BaseException):
                continue  # its client gets the error when it asks again
            try:
                result = self._acquire_meta(req, *self._meta_of(req, resolved), peer.uid, hit=False)
            except H5ServeError:
                continue  # answered to its client, the same way, at its next poll
            if result.name:
                self._grant(result.name, peer.uid)

    def _grant(self, file: str, uid: int) -> None:
        """Grant ``uid`` the segment published (or being loaded) as ``file``."""
        entry = self.entries.get(file)  # its keyed name, unless a planted file made it take a fresh one
        if entry is None or entry.file != file:
            entry = next((e for e in self.entries.values() if e.file == file), None)
        if entry is not None and grant(entry, uid, self.grants):
            self.grants = grants_of(self.entries.values())  # replaced, never mutated: the hand-out thread reads it

    def _find_or_load(self, req: Acquire, peer: Peer) -> AcquireResult:
        try:
            resolved = self.resolver.poll(req.path, req.key, peer, req.files, req.pins or req.pin)
        except AccessDenied:
            self.counters["refusals"] += 1
            raise
        if resolved is None:
            self._awaiting_resolution(req, peer)
            st = os.stat(self.shm_dir)
            return AcquireResult("loading", "", str(self.shm_dir), 0, 0, 0, os.getuid(), st.st_dev, st.st_ino)
        return self._acquire_meta(req, *self._meta_of(req, resolved), peer.uid)

    def _meta_of(self, req: Acquire, resolved: Resolved | ResolvedFiles,
                 ) -> tuple[SegmentMeta, Callable[[], tuple[tuple[int, int], ...]] | None, str]:
        """The segment ``req`` asks for, from its resolved file(s), how to plan its load's parts
        (None: the loader does), and its published name. Remembered per request while its file
        resolves alike (the same identities, ctime included, and dataset: a file changed since
        replaces the entry), the least recently used forgotten past MAX_REMEMBERED_METAS requests."""
        memo = (req.path, req.key, req.dtype, req.mode, req.world_size, req.rank, req.span, req.rows, req.files,
                req.pin, req.pins)
        found = self._metas.get(memo)
        if found is not None and (found[0] is resolved or found[0] == resolved):  # same identities, same rows
            meta, name = found[1], found[2]
        else:
            meta = self._build_meta(req, resolved)
            name = segment_name(self.namespace, meta, self.secret)
            self._metas.put(memo, (resolved, meta, name))
        if isinstance(resolved, ResolvedFiles):
            return meta, None, name
        info = resolved.info
        if resolved.remote:  # an s3:// object: one loader, its GETs in flight side by side (remoteload.py)
            return meta, None, name
        return meta, lambda: load_spans(info, meta, self.load_processes), name

    @staticmethod
    def _build_meta(req: Acquire, resolved: Resolved | ResolvedFiles) -> SegmentMeta:
        if isinstance(resolved, ResolvedFiles):
            return files_meta(req, resolved)
        ident, info = resolved.ident, resolved.info
        selection = Selection(req.mode, req.world_size, req.rank, req.span, req.rows)
        stored = storage_dtype(info.dtype, check_cast(info, resolve_dtype(req.dtype, "dtype")))
        return SegmentMeta(
            source_path=ident.path, source_dev=ident.dev, source_ino=ident.ino,
            source_size=ident.size, source_mtime_ns=ident.mtime_ns, key=req.key,
            mode=req.mode, world_size=req.world_size, rank=req.rank,
            total_rows=info.rows, rows=selection.count(info.rows), row_shape=info.row_shape,
            dtype=stored.str, source_dtype=info.dtype.str,
            linked=resolved.linked.as_tuple() if resolved.linked else (), span=req.span,
            depends=tuple(source.as_tuple() for source in resolved.sources),
            # variable-length rows: values estimated for the budget until the load counts them
            vlen=info.vlen, values=round(info.mean_length * selection.count(info.rows)) if info.vlen else 0,
            start=req.rows[0] if req.rows else 0,
            remote=(resolved.remote.etag, resolved.remote.version_id) if resolved.remote else (),
        )

    def _acquire_meta(self, req: Acquire, meta: SegmentMeta,
                      spans: Callable[[], tuple[tuple[int, int], ...]] | None, name: str, uid: int,
                      hit: bool = True) -> AcquireResult:
        """``acquire``, asked by ``uid``, once the request's files are resolved into the segment
        ``meta`` describes, published as ``name``; ``spans()`` plans its load's parts (None: the loader does). ``hit``:
        count a ready answer as a hit (not for a load started on a client's behalf).

        Raised when ``uid`` already has MAX_QUEUED_LOADS_PER_UID loads waiting: CapacityError.
        """
        if req.arena and not meta.vlen and not meta.files:  # a slot of the key's arena
            result = self.arenas.acquire(req, meta, None if spans is None else spans(), uid)
            if not self._answering:
                self.arenas.launch()
            return result
        entry = self.entries.get(name)
        if entry is not None and entry.state != "loading" and not self._ready_ok(entry):
            entry = None
        if entry is None:
            failure = self.failures.get(name)
            if failure is not None and time.monotonic() - failure.at < FAILURE_MEMORY_S:
                raise error_from_code(failure.code, failure.message)
            self.failures.pop(name, None)
            check_queue_of(self.loads.queued(), uid, meta, self.counters, self.arenas.queued_by(uid))
            entry = self._start(name, meta, uid, None if spans is None else spans(), req.prefetch)
            self.prefetched.asked(name, req.prefetch, True)
        else:
            self.prefetched.asked(name, req.prefetch, False)
            if entry.state == "loading" and entry.process is None:
                entry.waiting.add(uid)  # its start comes with this uid's turn too
        entry.last_used = time.monotonic()
        entry.asked_as = (req.mode, req.world_size, req.rank)
        entry.modes.add(req.mode)
        if entry.state == "stale":  # requested under the same identity again: the file is back
            entry.state = "ready"
        if entry.state == "ready":
            if hit:
                entry.hits += 1
                self.counters["hits"] += 1
            return self._result("ready", entry.file, entry.meta.rows, entry.meta, entry.stamp)
        done = read_progress(self.shm_dir / entry.tmp_name)[0] if entry.process else 0
        return self._result("loading", entry.file, done, entry.meta)

    def _ready_ok(self, entry: Entry) -> bool:
        """Whether a published segment is still as published (fstat: inode and ctime as
        recorded, and its header: cheap). If not (missing, truncated, made writable even if
        made read-only again, replaced, header rewritten) its name is removed and the entry
        dropped, so the caller loads it again; processes that mapped it keep their mapping."""
        path = self.shm_dir / entry.file
        try:
            header, stamp = check_published(path, entry.meta, entry.header or None, entry.stamp)
        except SegmentError as exc:
            log.warning("%s; loading %s[%s] %s again", printable(exc), printable(entry.meta.source_path),
                        printable(entry.meta.key), entry.meta.shard_label())
            self.counters["damaged"] += 1
            remove_if(path, keep=not_ours)
            del self.entries[entry.name]
            return False
        if not entry.header:  # adopted from a previous daemon: its header was checked against meta
            entry.header, entry.checksum, entry.stamp = header, header_checksum(header), stamp
        return True

    def _result(self, state: str, name: str, done: int, meta: SegmentMeta,
                stamp: PublishStamp = UNKNOWN_STAMP) -> AcquireResult:
        st = os.stat(self.shm_dir)
        return AcquireResult(state, name, str(self.shm_dir), done, meta.rows, meta.total_rows, os.getuid(),
                             st.st_dev, st.st_ino, stamp.ino, stamp.ctime_ns)

    def _start(self, name: str, meta: SegmentMeta, uid: int,
               spans: tuple[tuple[int, int], ...] | None = None, prefetch: bool = False) -> Entry:
        self.make_room(meta.allocated_size, meta, prefetch)  # variable-length rows: their estimate
        entry = Entry(name, meta, "loading", file=publish_name(self.shm_dir, name), requester=uid, waiting={uid},
                      tmp_name=temporary_name(self.namespace), spans=spans)
        self.entries[name] = entry
        self.loads.queue(entry)
        self.counters["loads_requested"] += 1
        if not self._answering:
            self._launch_pending()
        return entry

    @contextmanager
    def answering(self) -> Iterator[None]:
        """Requests answered inside start their loads on exit, after the replies: starting a
        loader through the forkserver holds the daemon 2-8 ms (more on a busy node), which every
        acquire answered "loading" (a stream prefetch: one per block and key) used to wait out."""
        self._answering = True
        try:
            yield
        finally:
            self._answering = False
            try:
                self._launch_pending()
                self.arenas.launch()
            except Exception:  # out of processes or descriptors: the daemon never dies of a request
                log.exception("could not start a loader; the load stays queued and is started again later")

    def _launch_pending(self) -> None:
        running = len(self.loads.running()) + self.arenas.running  # slot loads take loaders too
        while running < self.max_loaders:
            if self.arenas.take_turn():  # slot loads and segment loads take turns
                running += 1
                continue
            entry, self._last_uid = next_queued(self.loads.queued(), self._last_uid)
            if entry is None:
                return
            room = self._room_of(entry) if entry.meta.vlen else None
            job = LoadJob(self.shm_dir, entry.tmp_name, entry.file, entry.meta, self.group, os.getpid(),
                          self.load_processes, self.checksum, self._drops_pages(entry), entry.spans,
                          keep=entry.meta.mode == STREAM and (entry.spans is None and bool(entry.meta.remote)
                                                              or entry.spans is not None and len(entry.spans) == 1),
                          room=room, virtual_ok=entry.requester in (os.geteuid(), 0))
            entry.process, entry.reply = self.pool.launch(job)
            self.loads.start(entry)
            entry.room = 0 if room is None else room.limit  # counted from now on, until the load is done
            entry.load_started = entry.active_at = time.monotonic()
            running += 1
            size = format_bytes(entry.meta.nbytes) if room is None else (
                f"estimated {format_bytes(entry.meta.nbytes)}, room {format_bytes(room.limit)}")
            log.log(load_log_level(entry.meta), "loading %s[%s] %s (%s) into %s", printable(entry.meta.source_path),
                    printable(entry.meta.key), entry.meta.shard_label(), size, entry.file)

    def _drops_pages(self, entry: Entry) -> bool:
        """Whether ``entry``'s loader drops the source's cached pages of its rows: not while a
        queued load reads them too, and never for a stream block (evicted again within the
        epoch and read again the next: the page cache, not the budget, is what can keep it)."""
        return (self.drop_page_cache and entry.meta.mode != STREAM
                and not read_again_soon(self.loads.queued(), entry))

    def _room_of(self, entry: Entry) -> Room:
        """The room of a variable-length load about to start (counted once it runs: ``Entry.charge``): its
        estimate, counted since it was asked for, and half of what the budget has free now (a lone load may
        grow well past a short estimate; the other half stays for the loads asked next). Rooms are counted
        like segments: loads side by side never share the same free bytes, every segment within the budget."""
        free = max(self.max_memory - self.used_bytes(), 0)  # ``entry`` counted at its estimate (queued)
        room = entry.meta.allocated_size + free // 2 // PAGE_BYTES * PAGE_BYTES  # whole pages
        return Room(room, self.max_memory, self.budget_rule)

    def used_bytes(self) -> int:
        """What the budget counts now: every segment's pages in tmpfs, a variable-length load
        in flight its room (``Entry.charge``)."""
        return self.entries.ledger.total + self.arenas.nbytes  # kept as entries come, go and change (entries.Entries)

    def make_room(self, needed: int, meta: SegmentMeta, prefetch: bool = False, arena: object = None,
                   punch: bool = True) -> None:
        """Evict least-recently-used segments no client holds until ``needed`` fits the budget
        (for a ``prefetch``, never a stream block prefetched and not needed yet: prefetch.py).

        Raised when it cannot fit even then: BudgetExceeded.
        """
        used = self.used_bytes()
        if used + needed <= self.max_memory:
            return
        self.prefetched.forget(self.entries)
        for entry in self.prefetched.eviction_order(self.entries.values(), prefetch):
            if used + needed <= self.max_memory:
                return
            if entry.state in ("ready", "stale") and try_evict(self.shm_dir / entry.file):
                del self.entries[entry.name]
                used -= entry.charge
                self.counters["evictions"] += 1
                log.log(load_log_level(entry.meta), "evicted %s to make room", entry.file)
        if used + needed > self.max_memory and punch:  # unleased arena slots (not ``arena``'s) go
            used -= self.arenas.punch(used + needed - self.max_memory, keep=arena)
        if used + needed > self.max_memory:
            self.counters["refusals"] += not prefetch  # a prefetch refused is asked again when needed
            raise over_budget(meta, needed, used, self.max_memory, self.budget_rule)

    def sweep(self) -> None:
        """Evict ready segments whose source file changed (or vanished), once no client holds
        them (sweep.py: the files are stat-ed in a resolver thread)."""
        self._evict_changed(self._stale.poll(self.entries.values(), self.resolver.submit))

    def _evict_changed(self, changed: set[str]) -> None:
        for name in changed:
            entry = self.entries.get(name)
            if entry is None or entry.state == "loading":
                continue
            entry.state = "stale"
            if try_evict(self.shm_dir / entry.file):  # never raises: runs on the loop, outside any request
                del self.entries[entry.name]
                self.counters["evictions"] += 1
                self.counters["stale_evictions"] += 1
                log.info("evicted %s: %s changed on disk", entry.file, printable(entry.meta.source_path))

    def loads_pending(self) -> bool:
        """Whether a load runs or waits for a loader, or a request's file is still resolving
        (its load starts then): the idle exit (idle.py) waits for them."""
        return bool(self._resolving) or self.loads.loading() > 0 or self.arenas.pending()

    def load_fds(self) -> list[int]:
        """The pipes of running loaders: readable once a loader reports or dies, so the
        daemon's loop can wake for it instead of noticing on its next tick."""
        return ([e.reply.fileno() for e in self.loads.running() if e.reply is not None and not e.reply.closed]
                + self.arenas.fds())

    def _loading(self) -> bool:
        return bool(self.loads.running())

    def poll_loads(self) -> None:
        """Reap finished loaders (reaping.py: publish, fail, stop the stalled), then start queued
        loads in the slots freed."""
        self.reaper.poll()
        self.arenas.poll()
        self._launch_pending()
        self.arenas.launch()

    def spare_due_in(self) -> float:
        """Seconds until ``keep_spare`` would start a spare loader (inf: none is due)."""
        return self.pool.spare_due_in(self._loading())

    def keep_spare(self) -> None:
        """Let kept stream loaders idle too long go, and start a spare loader when one is due
        (loaderpool.py). The server calls it when no request waits (forking one holds the
        daemon up)."""
        self.reaper.reap_later(self.pool.expire())
        self.pool.keep_spare(self._loading())

    # ----- reporting and shutdown ----------------------------------------------------------
    def status(self, viewer: int | None = None) -> dict[str, Any]:
        """Every segment, or, for ``viewer`` (a uid) other than the daemon's and root, only those
        it was granted (memory totals and counters stay the daemon's)."""
        segments = segments_status(visible_to(self.entries.values(), viewer), self.shm_dir)
        st = os.statvfs(self.shm_dir)
        return {
            "segments": segments,
            "memory": {
                # used: what the budget counts (pages; a variable-length load's room); segment_bytes: the files' sizes
                "used": self.used_bytes(), "budget": self.max_memory, "budget_rule": self.budget_rule,
                "segment_bytes": sum(e.meta.file_size for e in self.entries.values()),
                "shm_free": st.f_bavail * st.f_frsize,
            },
            "counters": dict(self.counters),
            "errors": dict(self.errors),
            "remote": self._remote_status(),
            "arenas": self.arenas.report(),
        }

    def _remote_status(self) -> dict[str, Any]:
        """What loads of s3:// objects fetched: bytes, seconds, and the rate while fetching."""
        fetched, seconds = self.counters["remote_bytes"], self.counters["remote_fetch_ms"] / 1000
        return {"loads": self.counters["remote_loads"], "fetched_bytes": fetched, "fetch_seconds": seconds,
                "bytes_per_s": round(fetched / seconds) if seconds else 0}

    def shutdown(self) -> None:
        """Stop loaders and unlink every segment and temporary of this daemon.

        Clients that already mapped a segment keep reading it: unlink removes the name, the
        memory goes when the last mapping does.
        """
        self.arenas.close()
        self.pool.close()
        for entry in self.entries.values():
            if entry.process is not None:
                entry.process.kill()
                entry.process.join(timeout=5)
        # The namespace is this runtime dir, whose pidfile lock we hold: every regular file of
        # our euid under the prefix is ours (published, or a temporary of a loader we just
        # killed). The prefix is public, so anything else there is someone else's: left alone.
        for path in own_files(self.shm_dir, self.namespace):
            if not remove_if(path, keep=not_ours):
                log.warning("cannot remove segment %s; remove it by hand", path)
        self.entries.clear()
