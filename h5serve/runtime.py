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
import stat
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

__all__ = [
    "RuntimeLocation",
    "resolve_runtime",
    "resolve_shm_dir",
    "ensure_runtime_dir",
    "daemon_lock_held",
    "trusted_daemon_uids",
    "MAX_IPC_PATH",
    "DAEMON_USER_ENV",
]

MAX_IPC_PATH = 107  # sun_path is 108 bytes including the terminating NUL
SOCKET_NAME = "h5serve.sock"
PIDFILE_NAME = "h5serve.pid"
LOGFILE_NAME = "h5serve.log"
DAEMON_USER_ENV = "H5SERVE_DAEMON_USER"


@dataclass(frozen=True)
class RuntimeLocation:
    """Paths derived from one runtime dir."""

    directory: Path

    @property
    def socket_path(self) -> Path:
        return self.directory / SOCKET_NAME

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


def ensure_runtime_dir(location: RuntimeLocation, group: int | None = None) -> None:
    """Create the runtime dir 0700 (parents too); tighten an existing one of ours to 0700.
    With ``group`` (a gid), the dir is 0750 and belongs to that group, so its members can
    reach the socket.

    Raised when it cannot be created or belongs to another user: ConfigError.
    """
    try:
        location.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create runtime dir {location.directory}: {exc.strerror}") from exc
    st = location.directory.stat()
    if st.st_uid != os.getuid():
        raise ConfigError(
            f"runtime dir {location.directory} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); "
            "choose another --runtime-dir"
        )
    if group is not None:
        try:
            os.chown(location.directory, -1, group)
        except OSError as exc:
            raise ConfigError(f"cannot give runtime dir {location.directory} to group {group}: {exc.strerror}") from exc
    wanted = 0o700 if group is None else 0o750
    if stat.S_IMODE(st.st_mode) != wanted:
        os.chmod(location.directory, wanted)


def daemon_lock_held(location: RuntimeLocation) -> bool:
    """True when some process holds the daemon's exclusive lock on the pidfile."""
    try:
        fd = os.open(location.pidfile, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
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
