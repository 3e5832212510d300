"""What a request's file is, found off the control loop.

Resolving a request touches the file system and HDF5: opening the path, ``fstat``, reading
the dataset's metadata with h5py. On a hung network file system, or a FIFO an attacker put at
the path, any of these can block; the control loop must never. So they run in a small pool
of resolver threads, and the store waits for one only briefly (``RESOLVE_WAIT_S``: a local
file resolves in well under a millisecond) before answering "loading" and picking the result
up on the client's next poll.

One resolution opens the path once (``O_NONBLOCK``) and checks what it opened: its real path
under ``--allow-root``, and that the requesting user may read it (access.py). The threads do
only such os-level opens, ``fstat`` and access checks: HDF5 runs in a child process with a
deadline (inspector.py; a root daemon's child runs as the requesting user), which checks
that HDF5 opened that same file (device and inode) and reports the identity of the file an
external link led HDF5 to; that file is then checked like the first. The loader later reads
exactly these files (loader.open_source, identity.check_holder).

A virtual dataset's sources are opened by HDF5 by name whenever rows are read, so they
cannot be pinned to the files checked: virtual datasets are loaded only for the daemon's own
user and root; others get AccessDenied (their client reads lazily, with their own rights).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # TimeoutError itself from 3.11 on
from typing import Any

from ...errors import AccessDenied, H5ServeError, SourceChanged, SourceNotFound
from ...hdf5.identity import FileIdentity, open_identified
from ...hdf5.remote import RemoteIdentity, is_url, remote_identity, shown_url
from ...hdf5.source import DatasetInfo
from ...util.lru import LRU
from .inspection import Inspection
from .inspector import Credentials, inspect_file, virtual_refused
from .peer import Peer, check_peer_can_read
from .resolved import Resolved, ResolvedFiles
from .urls import UrlPolicy

__all__ = ["Resolver", "resolve_files", "RESOLVE_WAIT_S", "RESOLVE_TIMEOUT_S"]

log = logging.getLogger("h5serve.daemon")
RESOLVE_WAIT_S = 0.05  # how long the control loop waits for a resolution before answering "loading"
RESOLVE_TIMEOUT_S = 30.0  # a resolution still running after this fails its request
RESOLVE_PER_FILE_S = 0.05  # ... plus this per file of a multi-file request
RESOLVE_FRESH_S = 1.0  # a finished resolution not picked up within this is done again
RESOLVER_THREADS = 4
_PENDING_MAX = 1024
_INFO_CACHE_SIZE = 8192  # (file, key) pairs: a multi-file dataset has one per file


class _DaemonThreads:
    """A fixed pool of daemon threads: unlike ThreadPoolExecutor's, a thread stuck in a
    blocking open never keeps the daemon from exiting."""

    def __init__(self, count: int) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue())
        self._count = count
        for i in range(count):
            threading.Thread(target=self._work, name=f"h5serve-resolve-{i}", daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            del item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                    if not isinstance(exc, H5ServeError):
                        log.exception("internal error while resolving a request")
                    future.set_exception(_without_tracebacks(exc))
            del future  # while this thread waits, nothing of the last request stays alive

    def close(self) -> None:
        for _ in range(self._count):
            self._queue.put(None)


def _without_tracebacks(exc: BaseException) -> BaseException:
    """``exc`` and its causes with their tracebacks dropped: their frames hold h5py objects,
    and an h5py object keeps its file (and files reached through external links) open, so a
    refused file would stay open, and locked, for as long as the error is kept."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.__traceback__ = None
        current = current.__cause__ or current.__context__
    return exc


Pin = tuple[int, str, str]  # an s3:// object's identity as the client described it: size, ETag, version id


def _pending_key(path: str, key: str, peer: Peer, files: tuple[str, ...], pin: Pin | tuple[Pin, ...] | None,
                 ) -> tuple[object, ...]:
    """One resolution in flight per file (or file list, or object version), key and requesting identity."""
    return (files or path, key, peer.uid, peer.gid, pin)


def resolve_files(resolver: Resolver, paths: tuple[str, ...], key: str, peer: Peer) -> ResolvedFiles:
    """Resolve each file (blocking: a resolver thread runs this).

    Raised for the first file that cannot be served: the H5ServeError saying why, naming it.
    """
    return ResolvedFiles(tuple(resolver.resolve(path, key, peer) for path in paths))


class Resolver:
    """Resolves (path, key, peer) in threads; one ``Future`` per request in flight."""

    def __init__(self, allow_roots: tuple[str, ...] = (), urls: UrlPolicy | None = None) -> None:
        self.allow_roots = allow_roots
        self.urls = urls or UrlPolicy()
        # an s3:// object's dataset metadata, by its identity (ETag included) and key: read once per object
        self._remote_infos: LRU[tuple[RemoteIdentity, str], DatasetInfo] = LRU(_INFO_CACHE_SIZE)
        self._pool = _DaemonThreads(RESOLVER_THREADS)
        # keyed by the identity opened (ctime included: an in-place rewrite misses, whatever its
        # mtime says) and by the requesting uid: no user's verdict ever answers another's request
        self._infos: LRU[tuple[FileIdentity, str, int], DatasetInfo] = LRU(_INFO_CACHE_SIZE)
        self._pending: dict[tuple[object, ...], tuple[float, Future[Resolved]]] = {}
        self._done_at: dict[int, float] = {}  # id(future) -> when it finished (set by its done callback)
        # written to when a resolution finishes, so that the control loop (which polls the read
        # end) starts its load at once, whether or not the client asks again
        self.wake_fd, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def _finished(self, future: Future[Any]) -> None:
        self._done_at[id(future)] = time.monotonic()
        self._wake()

    def _stale(self, future: Future[Any]) -> bool:
        """Whether a finished resolution finished more than RESOLVE_FRESH_S ago (nobody picked
        it up in time: the file may have changed since)."""
        return future.done() and time.monotonic() - self._done_at.get(id(future), 0.0) > RESOLVE_FRESH_S

    def _drop(self, key: tuple[object, ...]) -> None:
        _, future = self._pending.pop(key)
        self._done_at.pop(id(future), None)

    def _wake(self, _: object = None) -> None:
        try:
            os.write(self._wake_w, b"!")
        except OSError:  # the pipe is full (the loop wakes anyway) or closed (stopping)
            pass

    def drain_wakes(self) -> None:
        """Empty the wake pipe (the control loop, once woken)."""
        try:
            while os.read(self.wake_fd, 4096):
                pass
        except OSError:  # empty: EAGAIN
            pass

    def peek(self, path: str, key: str, peer: Peer, files: tuple[str, ...] = (),
             pin: Pin | tuple[Pin, ...] | None = None) -> Resolved | ResolvedFiles | BaseException | None:
        """This request's resolution if it is done, without taking it (its client's next
        ``poll`` still gets it, error included): the result, the error it raised, or None while
        it runs or when none is in flight."""
        _, future = self._pending.get(_pending_key(path, key, peer, files, pin), (0.0, None))
        if future is None or not future.done():
            return None
        return future.exception() or future.result()

    def poll(self, path: str, key: str, peer: Peer, files: tuple[str, ...] = (),
             pin: Pin | tuple[Pin, ...] | None = None) -> Resolved | ResolvedFiles | None:
        """The resolution of this request: started now if none is in flight, waited for until
        RESOLVE_WAIT_S after it started; None while it is still running (ask again). ``files``: many files as
        one dataset, every one resolved (resolve_files; their segment: fileset.py). ``pin``: ``path``
        is an s3:// object the client described as this (``resolve_remote``); with ``files``, one
        per file: many s3:// objects, each resolved so (``resolve_remote_files``).

        Raised when the file cannot be served: the H5ServeError saying why.
        """
        pending_key = _pending_key(path, key, peer, files, pin)
        started, future = self._pending.get(pending_key, (0.0, None))
        if future is not None and self._stale(future):
            self._drop(pending_key)
            future = None  # an answer nobody picked up in time: the file may have changed since
        if future is None:
            if len(self._pending) >= _PENDING_MAX:
                self._forget_abandoned()
            if files and pin:
                future = self._pool.submit(self.resolve_remote_files, files, key, pin)
            elif files:
                future = self._pool.submit(resolve_files, self, files, key, peer)
            elif pin is not None:
                future = self._pool.submit(self.resolve_remote, path, key, pin)
            else:
                future = self._pool.submit(self.resolve, path, key, peer)
            started = time.monotonic()
            self._pending[pending_key] = (started, future)
            future.add_done_callback(self._finished)
        if not future.done():
            try:  # RESOLVE_WAIT_S in all per resolution: a burst of acquires for one file (a stream
                # job's prefetch: one per block and key) waited it out once each, holding the loop
                future.exception(timeout=max(started + RESOLVE_WAIT_S - time.monotonic(), 0.0))
            except FutureTimeout:
                limit = RESOLVE_TIMEOUT_S + RESOLVE_PER_FILE_S * len(files)
                if time.monotonic() - started < limit:
                    return None
                self._drop(pending_key)
                what = f"{path} (and the other {len(files) - 1} files)" if files else path
                raise SourceNotFound(
                    f"{what} did not open within {limit:g}s (a hung file system, or not a regular "
                    "file); check the path"
                ) from None
        self._drop(pending_key)
        error = future.exception()
        if error is not None:
            try:
                raise error
            finally:
                error = future = None  # noqa: F841 - no cycle through this frame keeps it alive
        return future.result()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run other blocking file-system work (the stale sweep's stats) on the resolver threads."""
        return self._pool.submit(fn, *args)

    def _forget_abandoned(self) -> None:
        """Drop finished resolutions no client came back for (it died, or gave up)."""
        for k, (_, future) in list(self._pending.items()):
            if self._stale(future):
                self._drop(k)

    def resolve_remote_files(self, urls: tuple[str, ...], key: str, pins: Pin | tuple[Pin, ...]) -> ResolvedFiles:
        """Many s3:// objects as one dataset, each resolved as ``resolve_remote`` resolves one.

        Raised for the first that cannot be served: its error, naming it."""
        assert len(pins) == len(urls) and all(isinstance(p, tuple) for p in pins)
        return ResolvedFiles(tuple(self.resolve_remote(url, key, p) for url, p in zip(urls, pins)))  # type: ignore[arg-type]

    def resolve_remote(self, url: str, key: str, pin: Pin) -> Resolved:
        """An s3:// object, for any peer: allowed (``--allow-url``, urls.py), looked up now with the
        daemon's own credentials (a HEAD), the version the client described (else SourceChanged),
        its dataset's metadata read once per version (in a child process, inspector.py).
        Blocking: runs in a resolver thread.

        Raised when the daemon may not fetch it: AccessDenied; when it changed: SourceChanged; as
        the store answers (ObjectNotFound, ObjectAccessDenied, ObjectStoreError)."""
        self.urls.check(url)
        now = remote_identity(url)
        if (now.size, now.etag, now.version_id) != pin:
            raise SourceChanged(f"{shown_url(url)} changed since this job described it (size {pin[0]:,}, ETag "
                                f"{pin[1] or '-'}; now {now.describe()}): restart the job to read the new object, and "
                                "write new data under new keys rather than over objects a job reads")
        info = self._remote_infos.get((now, key))
        if info is None:
            ident = FileIdentity(url, 0, 0, now.size, 0, 0)
            info = inspect_file(ident, key, None, virtual_ok=False, remote=now).info
            self._remote_infos.put((now, key), info)
        return Resolved(FileIdentity(url, 0, 0, now.size, 0, 0), info, None, (), remote=now)

    def resolve(self, path: str, key: str, peer: Peer) -> Resolved:
        """Open, check and inspect (blocking: runs in a resolver thread)."""
        if is_url(path):  # only with the object's identity (an acquire's ``pin``): resolve_remote
            raise AccessDenied(f"{shown_url(path)}: a URL must come with the object's identity (the client sends it)")
        fd, ident = open_identified(path)
        try:
            self._check_allowed(path, ident.path)
            check_peer_can_read(peer, ident)
        finally:
            os.close(fd)
        found = self._inspect(ident, key, peer)
        info, linked = found.info, found.linked
        if linked is not None:
            self._check_allowed(f"{info.linked_file} (an external link's target in {path})", linked.path)
            check_peer_can_read(peer, linked)
        if found.virtual and not _trusted(peer):
            raise virtual_refused(path, key, os.geteuid())
        return Resolved(ident, info, linked, tuple(self._check_other(path, p, peer) for p in info.virtual_sources))

    def _check_other(self, asked: str, path: str, peer: Peer) -> FileIdentity:
        """Open and check another file the rows of ``asked`` come from (a virtual dataset's
        source) as ``asked`` itself is checked: its identity. Raised as ``resolve``."""
        fd, ident = open_identified(path)
        try:
            self._check_allowed(f"{path} (a source of {asked})", ident.path)
            check_peer_can_read(peer, ident)
        finally:
            os.close(fd)
        return ident

    def _check_allowed(self, asked: str, real: str) -> None:
        """Raised when --allow-root is set and the opened file's real path is outside every
        root: AccessDenied."""
        if self.allow_roots and not any(os.path.commonpath([real, root]) == root for root in self.allow_roots):
            raise AccessDenied(
                f"{asked} (resolved to {real}) is outside the daemon's allowed roots "
                f"({', '.join(self.allow_roots)}); move the file there or restart the daemon with --allow-root"
            )

    def _inspect(self, ident: FileIdentity, key: str, peer: Peer) -> Inspection:
        """The dataset's metadata: from the cache (this user's inspection of this very file,
        unchanged since, with no external link or virtual dataset on the key's way: its
        metadata is the file's own), else from a child process (inspector.py), as the
        requesting user in a root daemon. The loader checks the layout again on the file it
        reads (identity.pinned_rows): the cache only spares an inspection."""
        cached = self._infos.get((ident, key, peer.uid))
        if cached is not None:
            return Inspection(cached, None, False)
        found = inspect_file(ident, key, _credentials(peer), virtual_ok=_trusted(peer))
        # another file's metadata (a link's target, a virtual source) can change under the same outer identity
        if found.linked is None and not found.virtual:
            self._infos.put((ident, key, peer.uid), found.info)
        return found

    def close(self) -> None:
        # (the wake pipe stays open: a thread still stuck in a resolution writes to it when it
        # returns, and a closed descriptor's number may by then name another file)
        self._pool.close()


def _trusted(peer: Peer) -> bool:
    """Whether ``peer`` is the daemon's own user or root (who could read any file anyway)."""
    return peer.uid in (os.geteuid(), 0)


def _credentials(peer: Peer) -> Credentials | None:
    """Whom a root daemon inspects a file as: the requesting user (None: as the daemon, for
    itself, root, or when the daemon is not root and cannot switch).

    Raised when the requesting process is gone: AccessDenied.
    """
    if os.geteuid() != 0 or _trusted(peer):
        return None
    groups = peer.groups()
    if groups is None:
        raise AccessDenied(f"the requesting process (pid {peer.pid}) is gone; ask again")
    return Credentials(peer.uid, peer.gid, groups)
