"""The control loop: a ZeroMQ ROUTER socket, request dispatch, signals, pidfile lock.

The loop never blocks on a load (loads run in loader processes) and never dies of input:
every request gets a reply, malformed ones an error reply.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import resource
import signal
import struct
import time
from collections.abc import Callable
from typing import Any

import zmq

from .. import __version__
from ..errors import (
    AccessDenied,
    ConfigError,
    DaemonAlreadyRunning,
    H5ServeError,
    OutOfResources,
    ProtocolError,
    code_for,
    host_error,
)
from ..segments.arena import ARENA_VERSION
from ..util.logtext import EscapingFilter
from ..util.safeio import open_regular, read_small
from ..util.units import format_bytes
from ..wire.protocol import (
    POLL_INTERVAL_S,
    VERSION,
    Acquire,
    Ping,
    Request,
    Shutdown,
    Status,
    decode_request,
    encode_error,
    encode_ok,
)
from ..wire.runtime import PIDFILE_NAME, SOCKET_NAME, ensure_runtime_dir
from .access.fdserver import HandoutServer
from .access.peer import Peer, requester
from .config import (
    DEFAULT_MEMORY_FRACTION,
    DaemonConfig,
    default_load_processes,
    default_loaders,
)
from .idle import IdleWatch, in_use
from .loading.loader import start_forkserver
from .metrics import Metrics
from .notify import Notifier
from .store.store import SegmentStore

__all__ = ["serve", "Server", "ConnectionGuard", "raise_open_file_limit"]

log = logging.getLogger("h5serve.daemon")
_MAX_MESSAGES_PER_TICK = 256
_GUARD_EVERY = 16  # messages answered between two looks at the connection guard
STATUS_SCHEMA_VERSION = 1
MAX_PEER_MESSAGE_BYTES = 1024 * 1024
MIN_OPEN_FILES = 256  # below it libzmq can abort before the guard (ConnectionGuard) can act
# A root daemon raises its hard limit to this (before dropping privileges, with --user): bursts
# of thousands of connections then never come near it (see ConnectionGuard for what a limit of
# 1,024 does under a burst of 1,500).
ROOT_OPEN_FILES = 65536


def _lock_pidfile(config: DaemonConfig, dir_fd: int) -> int:
    """Take the runtime dir's exclusive lock before touching the socket: ``bind`` on an ipc
    path would silently steal it from a running daemon. The pidfile is opened in the checked
    runtime dir, never through a symlink, and must be ours.

    Raised when another daemon holds it: DaemonAlreadyRunning. Raised when it is not a
    regular file of ours: ConfigError.
    """
    fd = open_regular(PIDFILE_NAME, ConfigError, owners={os.geteuid()}, flags=os.O_RDWR | os.O_CREAT,
                      dir_fd=dir_fd, hint=f"remove it from {config.location.directory}")[0]
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        pid = read_small(fd, 32).decode("ascii", "replace").strip() or "?"
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise DaemonAlreadyRunning(
                f"an h5serve daemon (pid {pid}) already serves {config.location.directory}") from exc
        raise ConfigError(f"cannot lock {config.location.pidfile}: {exc.strerror}") from exc
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    if config.group is not None:  # clients check the lock before connecting
        os.fchown(fd, -1, config.group)
        os.fchmod(fd, 0o640)
    return fd


def _peer_of(frame: zmq.Frame) -> Peer | None:
    """Who sent ``frame``: libzmq's SO_PEERCRED record of the ipc connection."""
    try:
        address = frame.get("Peer-Address")
    except zmq.ZMQError:
        return None
    return Peer.from_address(address if isinstance(address, str) else None)


def raise_open_file_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit (every client
    connection is a descriptor), and, as root, the hard limit itself to ROOT_OPEN_FILES (a
    root daemon, or root before it drops to ``--user``: privileges.drop_privileges calls this
    first); returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20  # Linux's default fs.nr_open: setrlimit refuses more
    target = min(ROOT_OPEN_FILES, _nr_open())
    if os.geteuid() == 0 and hard < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, target))
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        except (ValueError, OSError) as exc:  # no CAP_SYS_RESOURCE (a container): the guard copes
            log.warning("could not raise the hard open-file limit from %d to %d as root (%s): more clients than "
                        "that at once can abort the daemon; raise it (LimitNOFILE=, ulimit -Hn, docker --ulimit "
                        "nofile=)", hard, target, exc)
    if soft == resource.RLIM_INFINITY or soft >= hard:
        return soft if soft != resource.RLIM_INFINITY else hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
        return soft
    return hard


def _nr_open() -> int:
    """The kernel's ceiling for any process's open-file limit (fs.nr_open)."""
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 1 << 20


def open_fd_count() -> int:
    """Descriptors this process has open (from /proc; a bound listdir, never blocking)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # the listing's own descriptor
    except OSError:
        return 0


class ConnectionGuard:
    """Keeps the daemon under its open-file limit however many peers connect.

    libzmq (4.3.5 and its master) aborts the whole process when ``accept`` on an ipc listener
    fails with EMFILE (``errno_assert`` in ipc_listener.cpp lists ENFILE, not EMFILE), and its
    I/O thread accepts every pending connection as fast as peers make them; it has no option
    to cap them. So the daemon counts its descriptors whenever a peer connects (a socket
    monitor wakes its loop) and, ``reserve`` descriptors short of the limit, sheds load: it
    unbinds, which closes the listener and, in libzmq, every connection that listener
    accepted. Clients reconnect on their own and ask again (requests are idempotent) or fall
    back after their timeout; the daemon listens again as soon as the count is ``2 *
    reserve`` under the limit (at once, since shedding freed the descriptors).

    What it cannot do: every client it dropped reconnects within ZeroMQ's reconnect interval
    (100 ms) the moment it listens again, and libzmq's I/O thread accepts that herd faster than
    this Python loop reacts on a busy node. More clients than the limit, connecting at once,
    can still abort the daemon (docs/benchmarks.md, *Daemon internals*, has the runs that
    showed it, and that other marks do no better). The remedy is a limit above the node's
    clients: a root daemon raises its hard limit to ROOT_OPEN_FILES itself
    (raise_open_file_limit, also before dropping to --user); a service account needs
    LimitNOFILE= (systemd's default hard limit, 524,288, is plenty).
    """

    def __init__(self, sock: zmq.Socket, endpoint: str, bind: Callable[[], None], limit: int) -> None:
        self.sock = sock
        self.endpoint = endpoint
        self.bind = bind
        self.reserve = max(64, limit // 4)  # a burst overshoots the mark before the loop sees it
        self.high = limit - self.reserve  # shed connections at this many descriptors
        self.low = limit - 2 * self.reserve  # listen again at this many
        self.paused = False
        self.monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.estimate = open_fd_count()  # descriptors: counted, then moved by connection events

    def check(self) -> None:
        """Drain connection events; stop or resume listening as the descriptor count says."""
        while True:
            try:
                event = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            accepted = struct.unpack_from("=H", event[0])[0] == zmq.EVENT_ACCEPTED
            self.estimate += 1 if accepted else -1
        # counting /proc/self/fd lists a directory: only near the mark (the daemon's own
        # descriptors, loaders' pipes, are not in the estimate: the margin covers them)
        if not self.paused and self.estimate < self.high - self.reserve // 2:
            return
        used = self.estimate = open_fd_count()
        if not self.paused and used >= self.high:
            try:
                self.sock.unbind(self.endpoint)
            except zmq.ZMQError as exc:  # never let the guard take the daemon down
                log.warning("could not stop listening with %d open files: %s", used, exc)
                return
            self.paused = True
            log.warning("%d of %d open files in use: not accepting new connections, and dropped the current "
                        "ones (clients reconnect and ask again, or read lazily after their timeout); raise the "
                        "daemon's open-file limit (LimitNOFILE=, ulimit -Hn) to hold more clients at once",
                        used, self.high + self.reserve)
        elif self.paused and used <= self.low:
            try:
                self.bind()
            except (zmq.ZMQError, OSError) as exc:  # tried again on the next tick
                log.warning("could not listen again on %s: %s", self.endpoint, exc)
                return
            self.paused = False
            log.info("%d open files in use: accepting connections again", used)


class Server:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        if not config.shm_dir.is_dir():
            raise ConfigError(f"shm dir {config.shm_dir} does not exist; pass --shm-dir or mount a tmpfs there")
        budget, rule = config.max_memory, "--max-memory"
        if budget is None:
            st = os.statvfs(config.shm_dir)
            budget = int(st.f_bavail * st.f_frsize * DEFAULT_MEMORY_FRACTION)
            rule = f"{DEFAULT_MEMORY_FRACTION:.0%} of the free space in {config.shm_dir} at start"
        self.store = SegmentStore(
            config.location, config.shm_dir, budget, config.loaders or default_loaders(),
            group=config.group, allow_roots=config.allow_roots, budget_rule=rule, allow_urls=config.allow_urls,
            load_processes=config.load_processes or default_load_processes(),
            stall_timeout=config.stall_timeout, checksum=config.checksum,
            drop_page_cache=config.drop_page_cache, arenas=config.arenas and config.group is None,
        )
        self._stopping = False
        self._stop_reason = ""  # said in the log and to systemd (STATUS=) when the daemon stops on its own
        self.idle = IdleWatch(config.idle_exit) if config.idle_exit else None
        self._doing = ""  # what run() is doing, for the message if the OS refuses it
        self.started = time.time()
        self.notifier = Notifier()
        self.metrics: Metrics | None = None
        if config.metrics_port is not None or config.metrics_textfile is not None:
            self.metrics = Metrics(config.metrics_port, config.metrics_textfile, config.metrics_addr,
                                   config.metrics_paths, config.group)
            self.store.reaper.on_loaded = self.metrics.observe_load

    def handle(self, request: Request, peer: Peer | None = None) -> dict[str, Any]:
        if self.idle is not None and isinstance(request, (Acquire, Ping)):  # not status: idle.py
            self.idle.touch()
        if isinstance(request, Acquire):
            return self.store.acquire(request, requester(peer, self.config.group)).to_wire()
        info = {
            "pid": os.getpid(), "version": __version__, "protocol": VERSION,
            "runtime_dir": str(self.config.location.directory), "shm_dir": str(self.config.shm_dir),
            "uptime_s": round(time.time() - self.started, 3),
            "metrics_port": self.metrics.port if self.metrics is not None else None,
        }
        if isinstance(request, Status):  # another user sees only the segments it was granted
            idle = None if self.idle is None else self.idle.status(self.config.hold_dir)
            return {"schema_version": STATUS_SCHEMA_VERSION, **info, "idle_exit": idle,
                    **self.store.status(peer.uid if peer is not None else -1)}
        if isinstance(request, Shutdown):
            self._shutdown_by(peer)
        assert isinstance(request, (Ping, Shutdown))
        # a stream-mode client sizes its window by the budget; "used" lets a poller skip status's segment list
        # "arena": the arena layout's version this daemon offers (not sent when it offers none)
        return {**info, "budget": self.store.max_memory, "used": self.store.used_bytes(),
                **({"arena": ARENA_VERSION} if self.store.arenas.offered else {})}

    def _shutdown_by(self, peer: Peer | None) -> None:
        """Stop, when ``peer`` is the daemon's own user or root: a ``--group`` member may use the
        daemon, never stop it (it unlinks everyone's segments). Every request is logged, with
        the peer's uid and pid as the kernel reported them.

        Raised when anyone else (or a peer the kernel did not name) asks: AccessDenied.
        """
        who = "an unknown peer" if peer is None else f"uid {peer.uid} (pid {peer.pid})"
        if peer is None or peer.uid not in (os.geteuid(), 0):
            log.warning("shutdown requested by %s: refused (only uid %d, the daemon's user, or root may stop it)",
                        who, os.geteuid())
            # uids, not names: a user lookup (NSS, LDAP) could stall the control loop
            raise AccessDenied(f"only uid {os.geteuid()} (the daemon's user) or root may stop this daemon, not "
                               f"{who}; ask its owner or root to stop it")
        log.info("shutdown requested by %s: stopping", who)
        self._stopping = True

    def reply_to(self, frames: list[bytes], peer: Peer | None = None) -> bytes:
        """The reply to one request from ``peer`` (as the kernel reported it; None: unknown)."""
        request_id = 0
        try:
            if len(frames) != 1:
                raise ProtocolError(f"expected one frame per request, got {len(frames)}")
            request_id, request = decode_request(frames[0])
            return encode_ok(request_id, self.handle(request, peer))
        except H5ServeError as exc:
            self.store.errors[exc.code] += 1
            if isinstance(exc, (ProtocolError, ConfigError)):  # raised while decoding: the id it read, if any
                request_id = getattr(exc, "request_id", 0) or request_id  # 0: raised after decoding
            return encode_error(request_id, exc.code, str(exc))
        except Exception as exc:  # the daemon never dies of a request
            log.exception("internal error while handling a request")
            self.store.errors["internal"] += 1
            return encode_error(request_id, code_for(exc), f"internal daemon error: {type(exc).__name__}: {exc}")

    def request_stop(self, *_: object) -> None:
        self._stopping = True

    def _bind(self, sock: zmq.Socket, dir_fd: int) -> None:
        old_umask = os.umask(0o177)
        try:
            sock.bind(self.config.location.endpoint)
        finally:
            os.umask(old_umask)
        if self.config.group is not None:  # members of the group may connect
            os.chown(SOCKET_NAME, -1, self.config.group, dir_fd=dir_fd, follow_symlinks=False)
            os.chmod(SOCKET_NAME, 0o660, dir_fd=dir_fd)

    def run(self) -> None:
        """Serve until stopped. An OSError or ZMQError on the way (no open files left, the
        socket's name taken by a directory, ...) leaves as the HostError that says what to do."""
        self._doing = f"preparing the runtime dir {self.config.location.directory}"
        try:
            self._run()
        except (OSError, zmq.ZMQError) as exc:
            raise host_error(exc, self._doing) from exc

    def _run(self) -> None:
        location = self.config.location
        files_limit = raise_open_file_limit()
        if files_limit < MIN_OPEN_FILES:
            # below it libzmq can abort the process (an assert, not an error) before a client connects
            raise OutOfResources(
                f"the daemon may open at most {files_limit} files (its hard limit) and needs at least "
                f"{MIN_OPEN_FILES}; raise the open-file limit (`ulimit -Hn`, systemd LimitNOFILE=, "
                "docker --ulimit nofile=) and start it again"
            )
        dir_fd = ensure_runtime_dir(location, self.config.group)
        try:
            self._doing = f"locking {location.pidfile}"
            lock_fd = _lock_pidfile(self.config, dir_fd)
        except BaseException:
            os.close(dir_fd)
            raise
        ctx: zmq.Context | None = None
        handout: HandoutServer | None = None
        try:
            self._doing = f"adopting the segments left in {self.config.shm_dir}"
            self.store.recover()
            self._doing = "starting the loaders' forkserver"
            start_forkserver(bool(self.config.allow_urls))  # before the socket: no request waits for it
            self._doing = f"removing the stale socket {location.socket_path}"
            try:
                os.unlink(SOCKET_NAME, dir_fd=dir_fd)  # stale: we hold the lock
            except FileNotFoundError:
                pass
            except OSError as exc:  # a directory, or something we may not remove, in the socket's place
                raise host_error(exc, self._doing, fix=f"remove {location.socket_path} (it is in the way of the "
                                 "daemon's socket) or choose another --runtime-dir") from exc
            self._doing = f"listening on {location.endpoint}"
            ctx = zmq.Context()
            sock = ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # Frames up to 1 MiB get a protocol error reply (over MAX_FRAME_BYTES); a peer
            # sending more is disconnected before ZeroMQ allocates it.
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_PEER_MESSAGE_BYTES)
            self.guard = ConnectionGuard(sock, location.endpoint, lambda: self._bind(sock, dir_fd), files_limit)
            self._bind(sock, dir_fd)
            self._doing = f"listening on {location.handout_path}"
            handout = HandoutServer(location, dir_fd, self.config.shm_dir, self.config.group,
                                    lambda: self.store.grants)
            handout.start()
            signal.signal(signal.SIGTERM, self.request_stop)
            signal.signal(signal.SIGINT, self.request_stop)
            log.info(
                "h5serve %s serving %s (pid %d, shm %s, budget %s, %d loads at once, up to %d processes per load, "
                "%d open files%s)", __version__, location.endpoint, os.getpid(), self.config.shm_dir,
                format_bytes(self.store.max_memory), self.store.max_loaders, self.store.load_processes, files_limit,
                f", exits after {self.config.idle_exit:g}s unused" if self.config.idle_exit else "",
            )
            self.notifier.ready(self._status_line())
            self._doing = f"serving on {location.endpoint}"
            self._loop(sock)
        finally:
            log.info("stopping%s: unlinking segments", f" ({self._stop_reason})" if self._stop_reason else "")
            self.notifier.stopping(self._stop_reason)
            if handout is not None:
                handout.stop()
            self.store.shutdown()
            if ctx is not None:
                ctx.destroy(linger=0)
            self.store.resolver.close()
            for name in (SOCKET_NAME, PIDFILE_NAME):
                try:
                    os.unlink(name, dir_fd=dir_fd)
                except FileNotFoundError:
                    pass
                except OSError as exc:  # e.g. a directory in the socket's place: the error that stopped us says so
                    log.warning("could not remove %s: %s", location.directory / name, exc.strerror)
            os.close(lock_fd)
            os.close(dir_fd)
            self.notifier.close()
            if self.metrics is not None:
                self.metrics.refresh(self.store.status, force=True)
                self.metrics.close()
            log.info("stopped")

    def _loop(self, sock: zmq.Socket) -> None:
        while not self._stopping:
            # the socket, peers connecting (the guard counts descriptors), and the pipes of
            # running loaders (a load is done: wake now)
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(self.guard.monitor, zmq.POLLIN)
            for fd in self.store.load_fds():
                poller.register(fd, zmq.POLLIN)
            poller.register(self.store.resolver.wake_fd, zmq.POLLIN)  # a resolution finished
            try:
                # woken when a spare loader is due, to start it while nothing else waits
                ready = dict(poller.poll(int(min(POLL_INTERVAL_S, self.store.spare_due_in()) * 1000)))
            except zmq.ZMQError as exc:
                if exc.errno == errno.EINTR:
                    continue
                raise
            self.guard.check()
            # loaders first: a poll that arrives with its load's report is answered "ready"
            self.store.poll_loads()
            if self.store.resolver.wake_fd in ready:
                self.store.resolver.drain_wakes()
            self.store.start_resolved()  # loads of requests answered "loading" before their file resolved
            with self.store.answering():  # the loads asked for start after the replies
                self._answer(sock, sock in ready)
            if sock not in ready:
                self.store.keep_spare()
            self.store.sweep()
            self.notifier.tick(self.store.loads.loading() > 0)
            if self.notifier.enabled:  # a status line sums every segment: only for systemd to show
                self.notifier.status(self._status_line())
            if self.metrics is not None:
                self.metrics.refresh(self.store.status)
            self._exit_when_idle(sock)

    def _exit_when_idle(self, sock: zmq.Socket) -> None:
        """Stop, as `h5serve stop` does, once --idle-exit seconds passed unused (idle.py); not
        while a request waits on the socket (answered first: an acquire or ping cancels the exit)."""
        used = lambda: in_use(self.store, self.config.hold_dir)  # noqa: E731
        if self.idle is None or not self.idle.expired(used) or sock.poll(0, zmq.POLLIN):
            return
        self._stop_reason = f"idle for {self.idle.idle_for():.0f}s, --idle-exit {self.idle.seconds:g}"
        log.info("no request but status, no lease held on a segment and no load for %.1fs (--idle-exit %g): "
                 "exiting", self.idle.idle_for(), self.idle.seconds)
        self._stopping = True

    def _answer(self, sock: zmq.Socket, readable: bool) -> None:
        for n in range(_MAX_MESSAGES_PER_TICK if readable else 0):
            if n % _GUARD_EVERY == _GUARD_EVERY - 1:  # connections keep arriving while we answer
                self.guard.check()
            try:
                identity, *frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            peer = _peer_of(frames[0]) if frames else None
            reply = self.reply_to([f.bytes for f in frames], peer)
            try:
                sock.send_multipart([identity.bytes, reply], zmq.NOBLOCK)
            except zmq.ZMQError:  # the client went away (ROUTER_MANDATORY) or is not reading
                pass

    def _status_line(self) -> str:
        loading = self.store.loads.loading()
        return (
            f"{len(self.store.entries) - loading} segments ready, {loading} loading, "
            f"{format_bytes(self.store.used_bytes())} of {format_bytes(self.store.max_memory)}"
        )


def serve(config: DaemonConfig) -> None:
    """Run the daemon in this process until SIGTERM, SIGINT or a shutdown request.

    Raised when another daemon already serves the runtime dir: DaemonAlreadyRunning.
    Raised when the OS refuses something the daemon needs: HostError (a subclass by errno).
    """
    for handler in logging.getLogger().handlers:  # the daemon's log: one line per record, whatever users named
        if not any(isinstance(f, EscapingFilter) for f in handler.filters):
            handler.addFilter(EscapingFilter())
    try:
        server = Server(config)
    except (OSError, zmq.ZMQError) as exc:
        raise host_error(exc, f"setting up the daemon for {config.location.directory}") from exc
    server.run()
