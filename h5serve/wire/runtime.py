"""Where the daemon and its clients meet: runtime dir, socket, pidfile, shm dir.

This is the only module that reads H5SERVE_* / XDG_RUNTIME_DIR environment variables.

Runtime dir precedence: explicit argument > $H5SERVE_RUNTIME_DIR > $XDG_RUNTIME_DIR/h5serve
(only when $XDG_RUNTIME_DIR exists, is owned by us and is mode 0700) > /tmp/h5serve-$UID.
Shm dir precedence: explicit argument > $H5SERVE_SHM_DIR > /dev/shm.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import signal
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, DaemonUnavailable, UntrustedDaemon, host_error
from ..util.safeio import check_dir_stat, describe_owner, flocks, open_regular, read_small

__all__ = [
    "RuntimeLocation",
    "resolve_runtime",
    "resolve_shm_dir",
    "ensure_runtime_dir",
    "daemon_lock_held",
    "trusted_owner",
    "open_pidfile",
    "read_pid",
    "signal_daemon",
    "trusted_daemon_uids",
    "MAX_IPC_PATH",
    "DAEMON_USER_ENV",
    "ARENA_ENV",
    "arena_wanted",
    "SOCKET_NAME",
    "HANDOUT_SOCKET_NAME",
    "PIDFILE_NAME",
    "LOGFILE_NAME",
]

MAX_IPC_PATH = 107  # sun_path is 108 bytes including the terminating NUL
SOCKET_NAME = "h5serve.sock"
HANDOUT_SOCKET_NAME = "h5serve.fds"  # segment descriptors for the daemon's other users (daemon/access/fdserver.py)
PIDFILE_NAME = "h5serve.pid"
LOGFILE_NAME = "h5serve.log"
DAEMON_USER_ENV = "H5SERVE_DAEMON_USER"
# "0": no stream arenas (docs/architecture.md, *Stream arena*): a client set so asks for a segment
# per block, a daemon started so offers none (its ping says "arena" when it does)
ARENA_ENV = "H5SERVE_ARENA"


def arena_wanted() -> bool:
    """Whether stream blocks go to the daemon's arenas: yes unless ``ARENA_ENV=0``."""
    return os.environ.get(ARENA_ENV, "1").strip() != "0"


@dataclass(frozen=True)
class RuntimeLocation:
    """Paths derived from one runtime dir."""

    directory: Path

    @property
    def socket_path(self) -> Path:
        return self.directory / SOCKET_NAME

    @property
    def handout_path(self) -> Path:
        return self.directory / HANDOUT_SOCKET_NAME

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.socket_path}"

    @property
    def pidfile(self) -> Path:
        return self.directory / PIDFILE_NAME

    @property
    def logfile(self) -> Path:
        return self.directory / LOGFILE_NAME

    @property
    def namespace(self) -> str:
        """Short tag that keeps segments of daemons on different runtime dirs apart."""
        return hashlib.blake2b(str(self.directory).encode(), digest_size=4).hexdigest()


def _private_dir_ok(path: Path, uid: int) -> bool:
    try:
        st = path.stat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid and stat.S_IMODE(st.st_mode) & 0o077 == 0


def resolve_runtime(runtime_dir: str | os.PathLike[str] | None = None, uid: int | None = None) -> RuntimeLocation:
    """The runtime location to use, by the precedence in the module docstring. Does not create it.
    ``uid`` (default: ours) names the default /tmp/h5serve-$UID, for a root parent starting a
    daemon that will run as another user.

    Raised when the resulting socket path is too long for an ipc endpoint: ConfigError.
    """
    uid = os.getuid() if uid is None else uid
    if runtime_dir is not None and str(runtime_dir) != "":
        directory = Path(runtime_dir)
    elif os.environ.get("H5SERVE_RUNTIME_DIR"):
        directory = Path(os.environ["H5SERVE_RUNTIME_DIR"])
    elif os.environ.get("XDG_RUNTIME_DIR") and _private_dir_ok(Path(os.environ["XDG_RUNTIME_DIR"]), uid):
        directory = Path(os.environ["XDG_RUNTIME_DIR"]) / "h5serve"
    else:
        directory = Path(f"/tmp/h5serve-{uid}")
    location = RuntimeLocation(Path(os.path.abspath(directory)))
    if len(str(location.socket_path)) > MAX_IPC_PATH:
        raise ConfigError(
            f"runtime dir {location.directory} is too long: the socket path must be at most "
            f"{MAX_IPC_PATH} characters; choose a shorter --runtime-dir / H5SERVE_RUNTIME_DIR"
        )
    return location


def resolve_shm_dir(shm_dir: str | os.PathLike[str] | None = None) -> Path:
    """The directory that holds segments: explicit > $H5SERVE_SHM_DIR > /dev/shm."""
    if shm_dir is not None and str(shm_dir) != "":
        return Path(os.path.abspath(shm_dir))
    return Path(os.path.abspath(os.environ.get("H5SERVE_SHM_DIR") or "/dev/shm"))


def ensure_runtime_dir(location: RuntimeLocation, group: int | None = None) -> int:
    """Create the runtime dir 0700 (its parents too) or take an existing one of ours, and
    return a descriptor of it. Never follows a symlink at the runtime dir itself; mode and
    group are set through the descriptor. With ``group`` (a gid), the dir is 0750 and belongs
    to that group, so its members can reach the socket. Run as the user who will serve:
    a root parent starting a daemon for someone else drops privileges first (cli/start.py).

    Raised when it cannot be created, is a symlink or not a directory, or belongs to another
    user: ConfigError.
    """
    hint = "choose another --runtime-dir / H5SERVE_RUNTIME_DIR, or remove it"
    try:
        location.directory.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(location.directory, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot create runtime dir {location.directory}: {exc.strerror}") from exc
    uid = os.geteuid()
    try:
        fd = os.open(location.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        why = _why_not_a_dir(location.directory) or exc.strerror
        raise ConfigError(f"cannot use runtime dir {location.directory}: {why}; {hint}") from exc
    try:
        st = os.fstat(fd)
        if st.st_uid != uid:
            raise ConfigError(
                f"runtime dir {location.directory} belongs to {describe_owner(st.st_uid)}, not to you "
                f"({describe_owner(uid)}); {hint}"
            )
        if group is not None and st.st_gid != group:
            try:
                os.fchown(fd, -1, group)
            except OSError as exc:
                raise ConfigError(
                    f"cannot give runtime dir {location.directory} to group {group}: {exc.strerror}") from exc
        wanted = 0o700 if group is None else 0o750
        if stat.S_IMODE(st.st_mode) != wanted:
            os.fchmod(fd, wanted)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _why_not_a_dir(path: Path) -> str:
    try:
        st = os.lstat(path)
    except OSError:
        return ""
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    return "" if stat.S_ISDIR(st.st_mode) else "it is not a directory"


def trusted_owner(location: RuntimeLocation, trusted: frozenset[int]) -> int | None:
    """The uid of the daemon on ``location`` as the files prove it: the owner of the runtime
    dir, which must be one of ``trusted``, a directory (not a symlink) nobody else can write,
    holding a socket and pidfile of the same owner. None when no daemon has been there (no
    dir, no socket or pidfile, or something else at the socket's name).

    Raised when any of them is someone else's or of the wrong kind: UntrustedDaemon.
    Raised when this user may not look into the dir: DaemonUnavailable.
    """
    hint = (f"start your own daemon, set H5SERVE_RUNTIME_DIR to its dir, or set {DAEMON_USER_ENV} to the "
            "user that runs this node's shared daemon")
    try:
        st = os.lstat(location.directory)
    except (FileNotFoundError, NotADirectoryError):  # no dir there (or a file above it): no daemon either
        return None
    except OSError as exc:
        raise _not_accessible(location) from exc
    check_dir_stat(st, f"h5serve runtime dir {location.directory}", trusted, UntrustedDaemon, hint)
    owner = st.st_uid
    kinds = []
    for path in (location.socket_path, location.pidfile):
        try:
            entry = os.lstat(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _not_accessible(location) from exc
        if entry.st_uid != owner:
            raise UntrustedDaemon(
                f"{path} belongs to {describe_owner(entry.st_uid)}, not to the runtime dir's owner "
                f"({describe_owner(owner)}); refusing to talk to it; {hint}"
            )
        kinds.append(entry.st_mode)
    if not stat.S_ISSOCK(kinds[0]):
        return None  # a leftover, not a daemon's socket
    return owner


def _not_accessible(location: RuntimeLocation) -> DaemonUnavailable:
    return DaemonUnavailable(
        f"the h5serve runtime dir {location.directory} is not accessible to {describe_owner(os.getuid())}: "
        "use a daemon of your own, or ask its owner to start it with --group"
    )


def open_pidfile(location: RuntimeLocation, owner: int) -> int:
    """The daemon's pidfile opened read-only (no symlink, no FIFO), checked to be ``owner``'s.

    Raised when it is missing, of another kind or someone else's: UntrustedDaemon.
    """
    return open_regular(location.pidfile, UntrustedDaemon, owners={owner})[0]


def _open_pidfile_if_there(location: RuntimeLocation, owner: int) -> int | None:
    """``open_pidfile``, or None when the pidfile is gone (the daemon just stopped)."""
    try:
        return open_pidfile(location, owner)
    except UntrustedDaemon as exc:
        if isinstance(exc.__cause__, FileNotFoundError):
            return None
        raise


def read_pid(location: RuntimeLocation, owner: int) -> int:
    """The pid written in the daemon's pidfile (0 if none). Trust it only as far as
    ``daemon_process`` checks it.

    Raised as ``open_pidfile``: UntrustedDaemon.
    """
    fd = _open_pidfile_if_there(location, owner)
    if fd is None:
        return 0
    try:
        text = read_small(fd, 32).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    return int(text) if text.isdigit() else 0


def daemon_lock_held(location: RuntimeLocation, owner: int | None = None) -> bool:
    """True when some process holds the daemon's exclusive lock on the pidfile (``owner``'s
    pidfile, when given; default: the caller's)."""
    try:
        fd = open_pidfile(location, os.geteuid() if owner is None else owner)
    except UntrustedDaemon:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)
    return False


def trusted_daemon_uids(daemon_user: str | int | None = None) -> frozenset[int]:
    """The uids whose daemon a client trusts: its runtime dir, socket, pidfile and segments
    must belong to one of them. Ours, root's (root can read and write everything anyway), and
    the one explicitly configured for shared daemons (``--group`` or root-prolog setups):
    ``daemon_user`` > ``$H5SERVE_DAEMON_USER``, a user name or uid. Never what a daemon says
    about itself.

    Raised when the configured user does not exist: ConfigError.
    """
    uids = {os.getuid(), 0}
    configured = daemon_user if daemon_user is not None else os.environ.get(DAEMON_USER_ENV) or None
    if configured is not None:
        import pwd

        text = str(configured)
        try:
            uids.add(int(text) if text.isdigit() else pwd.getpwnam(text).pw_uid)
        except KeyError:
            raise ConfigError(
                f"daemon user {text!r} ({DAEMON_USER_ENV} or daemon_user=) is not a user on this machine"
            ) from None
    return frozenset(uids)


def _lock_holders(dev: int, ino: int) -> set[int]:
    """Pids holding an exclusive flock on the file (dev, ino)."""
    return {lock.pid for lock in flocks() if lock.exclusive and (lock.dev, lock.ino) == (dev, ino)}


def _process_uids(pid: int) -> tuple[int, ...]:
    """(real, effective, saved, fs) uids of ``pid``; () when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return tuple(int(n) for n in line.split()[1:])
    except (OSError, ValueError):
        pass
    return ()


def signal_daemon(location: RuntimeLocation, owner: int, sig: int) -> int:
    """Send ``sig`` to the daemon of ``location``, but only to a process proven to be it: it
    runs as ``owner`` (every uid) and holds the exclusive flock on the pidfile we opened. The
    pid written in the pidfile is only a hint; the signal goes through a pidfd taken before
    the checks, so a pid reused meanwhile is never hit. Returns the pid signalled, 0 when no
    process proves to be the daemon.
    """
    fd = _open_pidfile_if_there(location, owner)
    if fd is None:
        return 0
    try:
        st = os.fstat(fd)
        text = read_small(fd, 32).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    hinted = int(text) if text.isdigit() else 0
    for pid in sorted(_lock_holders(st.st_dev, st.st_ino), key=lambda p: p != hinted):
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            uids = _process_uids(pid)
            if not uids or any(u != owner for u in uids) or pid not in _lock_holders(st.st_dev, st.st_ino):
                continue
            signal.pidfd_send_signal(pidfd, sig)
            return pid
        except ProcessLookupError:  # exited since the checks: not ours to signal any more
            continue
        except PermissionError as exc:
            raise host_error(exc, f"signalling the daemon (pid {pid})",
                             fix=f"stop it as {describe_owner(owner)} or as root") from exc
        finally:
            os.close(pidfd)
    return 0
