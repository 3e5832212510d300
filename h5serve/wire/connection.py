"""Talking to the daemon: a ZeroMQ DEALER socket with request ids and timeouts.

Never blocks the process's exit or its garbage collector: every client's socket comes from one
ZeroMQ context per process (``_process_context``), which is never terminated, and is closed
with ``linger=0`` by ``close()`` or, for a client nobody closed, by a ``weakref.finalize`` when
the client is freed (by the collector, in a reference cycle) or at exit. ``Context.term()``
blocks until every socket of its context is closed, and pyzmq's ``Context.__del__`` calls it: a
client in a reference cycle, freed by the collector with its own context, hung there forever
(the collector clears the context's weak references to its sockets before any finalizer runs, so
``destroy()`` found no socket to close and ``term()`` waited for the open one).

Fork-safe in the redis-py way: the socket (and the process's context) remembers the pid that
made it; after a fork the child drops the inherited objects untouched (closing a parent's
ZeroMQ socket or context in a child can hang) and builds its own. Every receive is bounded by a
timeout; a timed-out socket is closed (``linger=0``) and rebuilt, so a late reply can never be
taken for the next one.
"""

from __future__ import annotations

import math
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

import zmq

from ..errors import DaemonUnavailable
from .arrival import PublishWatch
from .protocol import (
    MAX_REPLY_BYTES,
    POLL_INTERVAL_S,
    Acquire,
    AcquireResult,
    Ping,
    Request,
    Shutdown,
    Status,
    decode_reply,
    encode_request,
)
from .runtime import RuntimeLocation, daemon_lock_held, resolve_runtime, trusted_daemon_uids, trusted_owner

__all__ = ["DaemonClient", "DEFAULT_TIMEOUT_S", "FIRST_POLL_S", "TRUST_RECHECK_S", "WATCHED_POLL_S", "poll_pause"]


DEFAULT_TIMEOUT_S = 5.0
FIRST_POLL_S = 0.002
# The loader tells the daemon right after it renames the segment into place: a client woken by
# the rename that heard "loading" asks again about this much later (then twice that, ...).
ARRIVED_POLL_S = 0.0005
# Between polls of a load whose publication a PublishWatch will announce: the polls then only
# update the progress bar and notice a failed load or a dead daemon. Each poll wakes this
# process and the daemon, CPU a load on a small node would rather have (~20 polls of a
# 0.15 s load at the short pauses).
WATCHED_POLL_S = 0.2
# How long a connected client goes on trusting what it checked on disk (the runtime dir's,
# socket's and pidfile's owners, the daemon's lock) before it checks again. Stream mode sends
# hundreds of requests a second, and the checks (stats, an open and a flock) were a third of a
# rank's CPU. A socket only another trusted user could bind (the runtime dir is writable by
# its owner alone, checked) is what zmq reconnects to if the daemon restarts meanwhile.
TRUST_RECHECK_S = 1.0


class _ProcessContext(zmq.Context):
    """The ZeroMQ context of every DaemonClient of one process: never terminated (the process's
    end frees its I/O thread), so nothing ever waits in ``term()`` for a socket left open."""

    def __del__(self) -> None:
        pass  # not pyzmq's: that one terms, and would block while any socket of it is open


_contexts: dict[int, zmq.Context] = {}  # by pid: a forked child never uses (or closes) its parent's
_inherited: list[zmq.Socket] = []  # a forked child's copies of its parent's sockets (_close_socket)


def _process_context() -> zmq.Context:
    """This process's context for daemon connections, made at its first use (in a forked child:
    its own, the parent's left untouched).

    Raised when ZeroMQ cannot make one (no open files left): zmq.ZMQError."""
    pid = os.getpid()
    context = _contexts.get(pid)
    if context is None:
        made = _ProcessContext()
        context = _contexts.setdefault(pid, made)  # atomic: two threads keep the same one
        if context is not made:
            made.term()  # no socket was made on it: returns at once
    return context


def _close_socket(sock: zmq.Socket, pid: int) -> None:
    """Close ``sock`` without waiting (``linger=0``) if this process made it: a client's
    ``close()``, or its finalizer when the client is freed unclosed or the interpreter exits.
    A forked child's copy of its parent's socket is never closed, nor freed (pyzmq warns)."""
    if os.getpid() != pid:
        _inherited.append(sock)
        return
    try:
        sock.close(linger=0)
    except zmq.ZMQError:
        pass  # closed already


def poll_pause(waited: float) -> float:
    """The pause before polling a load again, ``waited`` seconds into the wait: a tenth of it,
    FIRST_POLL_S to POLL_INTERVAL_S (a publication ends it early: ``acquire``)."""
    return min(max(waited / 10, FIRST_POLL_S), POLL_INTERVAL_S)


class DaemonClient:
    """Requests to the daemon of one runtime dir. Cheap to create; close() when done.

    It talks only to a daemon it trusts: one whose runtime dir, socket and pidfile belong to
    this user, root, or ``daemon_user`` (default ``$H5SERVE_DAEMON_USER``), checked on disk
    before every connection (``runtime.trusted_owner``); ``daemon_uid`` is that owner, the
    only uid whose segments this process maps.
    """

    def __init__(self, runtime_dir: str | os.PathLike[str] | None = None, timeout: float | None = None,
                 daemon_user: str | int | None = None) -> None:
        self.location: RuntimeLocation = resolve_runtime(runtime_dir)
        self.trusted = trusted_daemon_uids(daemon_user)
        self.daemon_uid: int | None = None
        self.timeout = DEFAULT_TIMEOUT_S if timeout is None else float(timeout)
        self._pid = -1
        self._sock: zmq.Socket | None = None
        self._closer: weakref.finalize | None = None  # closes _sock, also when this client is freed unclosed
        self._next_id = 0
        self._trusted_until = 0.0  # a monotonic time: the on-disk checks passed on this socket until then

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection (at once: nothing waits to be sent); the next request opens
        another. In a forked child, the parent's socket is dropped untouched."""
        closer, self._closer, self._sock = self._closer, None, None
        self._trusted_until = 0.0
        if closer is not None:
            closer()

    def _socket(self) -> zmq.Socket:
        if self._pid != os.getpid():  # new process: never touch the parent's socket or context
            self.close()
        if self._sock is None:
            sock = _process_context().socket(zmq.DEALER)
            try:
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
                sock.connect(self.location.endpoint)
            except BaseException:
                sock.close(linger=0)
                raise
            self._pid = os.getpid()
            self._sock = sock
            self._closer = weakref.finalize(self, _close_socket, sock, self._pid)
        return self._sock

    def available(self) -> bool:
        """A trusted daemon holds this runtime dir's lock and its socket exists (no round trip).

        Raised when the runtime dir, socket or pidfile belongs to an untrusted user or can be
        written by others: UntrustedDaemon. Raised when the runtime dir is not accessible to
        this user: DaemonUnavailable.
        """
        owner = trusted_owner(self.location, self.trusted)
        if owner is None:
            return False
        self.daemon_uid = owner
        return daemon_lock_held(self.location, owner)

    def _checked(self) -> bool:
        """``available()``, or True without looking again while this process's live socket
        passed it less than TRUST_RECHECK_S ago."""
        now = time.monotonic()
        if self._sock is not None and self._pid == os.getpid() and now < self._trusted_until:
            return True
        if not self.available():
            return False
        self._trusted_until = now + TRUST_RECHECK_S
        return True

    def request(self, request: Request, timeout: float | None = None, retries: int = 1) -> dict[str, Any]:
        """Send one request and wait for its reply; on a timeout, rebuild the socket and send
        it again up to ``retries`` times (every request is idempotent).

        Raised when no daemon runs there or it does not answer in time: DaemonUnavailable.
        Raised when the daemon answers with an error: that error's H5ServeError subclass.
        """
        self._check_available()
        timeout = self.timeout if timeout is None else timeout
        for _ in range(retries + 1):
            reply = self._round_trip(request, timeout)
            if reply is not None:
                if isinstance(reply, Exception):
                    raise reply
                return reply
            if not self.available():
                break
        raise DaemonUnavailable(
            f"the h5serve daemon at {self.location.endpoint} did not answer within {timeout:g}s; "
            "check `h5serve status` and its log, or raise timeout="
        )

    def _check_available(self) -> None:
        if not self._checked():
            raise DaemonUnavailable(
                f"no h5serve daemon is running on {self.location.directory}; start one with "
                f"`h5serve start` (or set H5SERVE_RUNTIME_DIR / runtime_dir to where it runs)"
            )

    def request_many(self, requests: list[Request]) -> list[dict[str, Any] | Exception]:
        """Send every request at once, then take their replies (one wait for them all, not a
        round trip each): each a result, or the error its reply carries (not raised). Idempotent
        requests only (stream mode's prefetches).

        Raised when no daemon runs there or the replies do not all come within the timeout:
        DaemonUnavailable."""
        self._check_available()
        first = self._next_id + 1
        replies = self._exchange(requests, self.timeout)
        if len(replies) < len(requests):
            raise DaemonUnavailable(
                f"the h5serve daemon at {self.location.endpoint} answered {len(replies)} of {len(requests)} requests "
                f"within {self.timeout:g}s; check `h5serve status` and its log, or raise timeout=")
        return [replies[first + i] for i in range(len(requests))]

    def _round_trip(self, request: Request, timeout: float) -> dict[str, Any] | Exception | None:
        """The reply (a result, or the error to raise), or None on timeout."""
        request_id = self._next_id + 1
        return self._exchange([request], timeout).get(request_id)

    def _exchange(self, requests: list[Request], timeout: float) -> dict[int, dict[str, Any] | Exception]:
        """Send ``requests`` (ids after ``_next_id``), then take their replies by id until all came
        or ``timeout`` passed; a late reply to an earlier request is dropped. Short of replies,
        the socket is closed: it is never reused while it may still receive them."""
        first = self._next_id + 1
        self._next_id += len(requests)
        replies: dict[int, dict[str, Any] | Exception] = {}
        if not requests:
            return replies
        try:
            sock = self._socket()  # inside: a new socket (or context) can fail too (no open files left)
            for i, request in enumerate(requests):
                sock.send(encode_request(first + i, request), zmq.NOBLOCK)
            deadline = time.monotonic() + timeout
            while len(replies) < len(requests) and (remaining := deadline - time.monotonic()) > 0:
                if not sock.poll(int(remaining * 1000) + 1, zmq.POLLIN):
                    continue
                reply_id, result = decode_reply(sock.recv())
                if first <= reply_id <= self._next_id:
                    replies[reply_id] = result
        except zmq.ZMQError as exc:
            self.close()
            raise DaemonUnavailable(f"cannot talk to the daemon at {self.location.endpoint}: {exc}") from exc
        if len(replies) < len(requests):
            self.close()
        return replies

    def ping(self) -> dict[str, Any]:
        return self.request(Ping())

    def status(self) -> dict[str, Any]:
        return self.request(Status())

    def shutdown(self) -> dict[str, Any]:
        return self.request(Shutdown(), retries=0)

    def request_by(self, request: Request, deadline: float | None) -> dict[str, Any]:
        """``request`` with every wait over by ``deadline`` (a ``time.monotonic()`` value; None:
        ``request``'s own timeout and retry).

        Raised when no reply came in time, or the deadline has passed: DaemonUnavailable.
        Raised when the daemon answers with an error: that error's H5ServeError subclass.
        """
        if deadline is None:
            return self.request(request)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DaemonUnavailable(f"no time left of timeout={self.timeout:g}s to ask the daemon at "
                                    f"{self.location.endpoint}; raise timeout= (None: wait while the load progresses)")
        timeout = min(self.timeout, max(round(remaining, 2), 0.01))  # to 10 ms: messages name the timeout= given
        return self.request(request, timeout=timeout, retries=1 if 2 * timeout <= remaining else 0)

    def acquire(
        self, request: Acquire, on_progress: Callable[[AcquireResult], None] | None = None,
        deadline: float | None = None,
    ) -> AcquireResult:
        """Ask for a segment and poll until it is loaded. Each poll is bounded by the timeout,
        so a daemon that dies mid-load surfaces as DaemonUnavailable, never a hang. The pause
        between polls (``poll_pause``) is cut short the moment the segment's name is published
        in the shm dir (inotify: arrival.py), so a finished load is noticed within a
        round trip or two rather than at the next poll.

        ``deadline`` (a ``time.monotonic()`` value) bounds the whole wait, polls included;
        None waits as long as the daemon answers each poll and the load goes on (the daemon
        fails a load that stops making progress: its ``--stall-timeout``).

        Raised when the load is not done by ``deadline``, or the daemon does not answer:
        DaemonUnavailable. Raised when the load fails: the daemon's error class.
        """
        started = time.monotonic()
        watch: PublishWatch | None = None
        quick = ARRIVED_POLL_S  # the pause once the name is there (the daemon is told within moments)
        try:
            while True:
                result = AcquireResult.from_wire(self.request_by(request, deadline))
                if result.state == "ready":
                    return result
                if on_progress is not None:
                    on_progress(result)
                if watch is None and result.name:
                    watch = PublishWatch(result.shm_dir, result.name)
                pause = poll_pause(time.monotonic() - started)
                if deadline is not None and time.monotonic() + pause >= deadline:
                    raise DaemonUnavailable(
                        f"the daemon's load of {request.path}[{request.key}] rank {request.rank}/"
                        f"{request.world_size} did not finish within timeout={self.timeout:g}s ({result.rows_done} "
                        f"of {result.rows_total} rows so far; it goes on for later jobs); pass a larger timeout=, "
                        "or timeout=None to wait as long as the load makes progress"
                    )
                if watch is not None and watch.watching:  # longer, leaving the last short pause for a last poll
                    left = math.inf if deadline is None else deadline - time.monotonic() - pause
                    pause = max(pause, min(WATCHED_POLL_S, left))
                if watch is None:
                    time.sleep(pause)
                elif watch.arrived:  # published, the daemon not yet told: ask again soon, then less often
                    time.sleep(min(quick, pause))
                    quick *= 2
                else:
                    watch.wait(pause)
        finally:
            if watch is not None:
                watch.close()


