"""Every error h5serve raises on purpose.

    H5ServeError                    base: catch this to catch everything below
    ├── ConfigError                 a bad argument or setting (mode, rank, runtime dir, size)
    ├── DataError                   the HDF5 source cannot be served as asked
    │   ├── SourceNotFound          the file does not exist or cannot be opened
    │   │   └── ObjectNotFound      a remote file's object or bucket does not exist (HTTP 404)
    │   ├── KeyNotFound             the dataset key is not in the file
    │   ├── UnsupportedDataset      no rows dimension, or a dtype h5serve cannot serve
    │   ├── LengthMismatch          the keys have different numbers of rows
    │   ├── SourceChanged           the file changed while it was being loaded
    │   ├── AccessDenied            the daemon may not serve that file (--allow-root)
    │   │   └── ObjectAccessDenied  the object store refused the credentials found (HTTP 401, 403)
    │   └── ObjectStoreError        a remote file (s3://, https://) failed: 5xx, throttling, timeouts, resets
    ├── CapacityError               not enough room to hold a shard
    │   ├── ShmFull                 the shm filesystem has less free space than the shard needs
    │   └── BudgetExceeded          the daemon's --max-memory cannot fit the shard
    ├── SegmentError                a shared-memory segment is missing, foreign or invalid
    ├── DaemonUnavailable           no daemon answered on the runtime dir in time
    │   └── UntrustedDaemon         the runtime dir, socket or pidfile belongs to someone untrusted
    ├── DaemonAlreadyRunning        ``start --foreground`` found a live daemon on the runtime dir
    ├── HostError                   the machine refused a file, socket or process h5serve needs (OSError, ZMQError)
    │   ├── AddressInUse            a port or socket path that something else holds
    │   ├── NoPermission            the OS refused this user a file, directory or process
    │   └── OutOfResources          too many open files, no space left, no memory
    ├── ProtocolError               a message that does not follow the wire protocol
    └── RemoteError                 the daemon failed in a way that has no more specific class

Which errors a client meets reading with ``fallback="lazy"`` turn into lazy h5py reads is
decided here, once, by each class's ``falls_back``: everything the daemon or shared memory can
fail with falls back; a bad argument (ConfigError) or data no reader can serve (KeyNotFound,
UnsupportedDataset, LengthMismatch) does not, because lazy reads would fail the same way.
``SourceNotFound`` falls back: the daemon may not see a file the job sees (another mount
namespace, other permissions); if the job cannot read it either, the lazy reader says so.

Errors from ZeroMQ, the OS and h5py are translated into these classes where they happen
(``raise ... from exc``), so callers never need to catch third-party exceptions. An
``OSError`` or ``zmq.ZMQError`` becomes a HostError in one place, ``host_error``, which picks
the class by errno and says what to do; the ``h5serve`` command maps whatever reaches it
through the same function, so an environment problem is never shown as a traceback.

``ERROR_CODES`` maps the wire error codes (wire/protocol.py) to classes and back: the daemon
sends ``code`` + ``message``; the client raises the same class the daemon caught. It is
built from the tree, so a new class is on the wire as soon as it is defined here.
"""

from __future__ import annotations

import errno as _errno
from collections.abc import Iterator

__all__ = [
    "H5ServeError",
    "ConfigError",
    "DataError",
    "SourceNotFound",
    "KeyNotFound",
    "UnsupportedDataset",
    "LengthMismatch",
    "SourceChanged",
    "AccessDenied",
    "ObjectStoreError",
    "ObjectNotFound",
    "ObjectAccessDenied",
    "CapacityError",
    "ShmFull",
    "BudgetExceeded",
    "SegmentError",
    "DaemonUnavailable",
    "UntrustedDaemon",
    "DaemonAlreadyRunning",
    "HostError",
    "AddressInUse",
    "NoPermission",
    "OutOfResources",
    "ProtocolError",
    "RemoteError",
    "ERROR_CODES",
    "code_for",
    "error_from_code",
    "falls_back",
    "host_error",
    "error_classes",
]


class H5ServeError(Exception):
    """Base class of every error h5serve raises on purpose."""

    code = "error"
    falls_back = True  # a failure of the daemon or of shared memory: lazy reads can serve the rows


class ConfigError(H5ServeError, ValueError):
    """Raised when an argument or setting is invalid (bad mode, rank out of range, ...)."""

    code = "config"
    falls_back = False


class DataError(H5ServeError):
    """Raised when the HDF5 source cannot be served as requested."""

    code = "data"
    falls_back = False


class SourceNotFound(DataError, FileNotFoundError):
    """Raised when the HDF5 file does not exist or is not a readable HDF5 file."""

    code = "source_not_found"
    falls_back = True


class KeyNotFound(DataError, KeyError):
    """Raised when the dataset key is not in the file (the message lists the keys that are)."""

    code = "key_not_found"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class UnsupportedDataset(DataError, TypeError):
    """Raised when a dataset has no rows dimension or a dtype that is not plain numeric."""

    code = "unsupported_dataset"


class LengthMismatch(DataError):
    """Raised when the keys of a dataset (x and y, or every key of keys=) have different numbers of rows."""

    code = "length_mismatch"


class SourceChanged(DataError):
    """Raised when the HDF5 file was modified while a shard of it was being loaded."""

    code = "source_changed"
    falls_back = True


class AccessDenied(DataError, PermissionError):
    """Raised when the daemon may not serve the file: outside every --allow-root, or not
    readable by the user who asked for it."""

    code = "access_denied"
    falls_back = True


class _RemoteDetails(Exception):
    """What the errors of remote files (h5serve/hdf5/remote.py) carry besides their message:
    ``url``, the file as messages show it (never credentials), and ``status``, the HTTP status
    when there was one (else None)."""

    def __init__(self, message: str = "", *, url: str = "", status: int | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.status = status


class ObjectNotFound(_RemoteDetails, SourceNotFound):
    """Raised when a remote file's object, or its bucket, does not exist (HTTP 404). Falls back
    as SourceNotFound does: a daemon reading with its own credentials and endpoint may not see
    what the job sees."""

    code = "object_not_found"


class ObjectAccessDenied(_RemoteDetails, AccessDenied):
    """Raised when the object store refuses the credentials found (HTTP 401, 403: no
    credentials, wrong ones, or a bucket policy that denies them). Falls back as AccessDenied
    does: the job's own credentials may be allowed what a daemon's are not."""

    code = "object_access_denied"


class ObjectStoreError(_RemoteDetails, DataError):
    """Raised when reading a remote file (``s3://``, ``https://``: h5serve/hdf5/remote.py) fails
    after its retries: a server error or throttling (5xx, 429), a timeout, a connection reset,
    a response cut short. Falls back: a daemon's failed fetch leaves the job's own reads."""

    code = "object_store"
    falls_back = True


class CapacityError(H5ServeError):
    """Raised when there is not enough room to hold a shard in shared memory."""

    code = "capacity"


class ShmFull(CapacityError):
    """Raised when the shm filesystem has less free space than the shard needs."""

    code = "shm_full"


class BudgetExceeded(CapacityError):
    """Raised when the shard does not fit in the daemon's --max-memory budget."""

    code = "budget_exceeded"


class SegmentError(H5ServeError):
    """Raised when a segment is missing, evicted, truncated or not written by h5serve."""

    code = "segment"


class DaemonUnavailable(H5ServeError):
    """Raised when no daemon answers on the runtime dir within the timeout."""

    code = "daemon_unavailable"


class UntrustedDaemon(DaemonUnavailable):
    """Raised when the runtime dir, its socket or pidfile, or a segment belongs to a user the
    client does not trust (not itself, not root, not ``H5SERVE_DAEMON_USER``), or can be
    written by others."""

    code = "untrusted_daemon"


class DaemonAlreadyRunning(H5ServeError):
    """Raised when a daemon already holds the runtime dir's pidfile lock."""

    code = "already_running"


class HostError(H5ServeError):
    """Raised when the operating system refuses something h5serve needs (a file, directory,
    socket, port or process) for a reason outside h5serve: made by ``host_error`` from an
    ``OSError`` or ``zmq.ZMQError``, which it keeps as ``__cause__``."""

    code = "host"


class AddressInUse(HostError):
    """Raised when a port or socket path h5serve would listen on is held by something else."""

    code = "address_in_use"


class NoPermission(HostError):
    """Raised when the OS refuses this user a file, directory or process (EACCES, EPERM)."""

    code = "no_permission"


class OutOfResources(HostError):
    """Raised when the machine runs out of open files, disk or shm space, or memory."""

    code = "out_of_resources"


class ProtocolError(H5ServeError):
    """Raised when a message does not follow the h5serve wire protocol. ``request_id`` is
    set when the envelope was readable, so the error reply can carry it."""

    code = "protocol"
    request_id = 0


class RemoteError(H5ServeError):
    """Raised when the daemon reports a failure with no more specific error class."""

    code = "remote"


def error_classes() -> Iterator[type[H5ServeError]]:
    """H5ServeError and every class below it, parents before children."""
    todo: list[type[H5ServeError]] = [H5ServeError]
    while todo:
        cls = todo.pop(0)
        yield cls
        todo.extend(cls.__subclasses__())


ERROR_CODES: dict[str, type[H5ServeError]] = {cls.code: cls for cls in error_classes()}


def code_for(exc: BaseException) -> str:
    """The wire code for an exception: its class code, or ``remote`` for anything else."""
    return exc.code if isinstance(exc, H5ServeError) else RemoteError.code


def error_from_code(code: str, message: str) -> H5ServeError:
    """The exception the client raises for an error reply from the daemon."""
    return ERROR_CODES.get(code, RemoteError)(message)


def falls_back(exc: BaseException) -> bool:
    """True when a client with ``fallback="lazy"`` reads lazily after ``exc`` instead of raising it."""
    return isinstance(exc, H5ServeError) and type(exc).falls_back


# errno -> (class, what to do); "{path}" is the file the OS named, or what h5serve was doing.
_BY_ERRNO: dict[int, tuple[type[HostError], str]] = {
    _errno.EADDRINUSE: (AddressInUse, "stop what holds it (`ss -lxp` / `ss -ltnp` shows who), or choose another"),
    _errno.EACCES: (NoPermission, "run h5serve as the user that owns {path}, or give this user access to it"),
    _errno.EPERM: (NoPermission, "run h5serve as the user that owns {path}, or give this user access to it"),
    _errno.EROFS: (NoPermission, "{path} is on a read-only file system: choose a writable place"),
    _errno.EMFILE: (OutOfResources, "raise the open-file limit (`ulimit -n`, systemd LimitNOFILE=) and try again"),
    _errno.ENFILE: (OutOfResources, "the whole machine is out of open files: close some, or raise fs.file-max"),
    _errno.ENOSPC: (OutOfResources, "free space on the file system of {path} (`df -h`), or choose another place"),
    _errno.EDQUOT: (OutOfResources, "this user's disk quota is used up on {path}: free some or choose another place"),
    _errno.ENOMEM: (OutOfResources, "free memory on this node, or lower --max-memory / --loaders"),
    _errno.ENOENT: (HostError, "{path} (or a directory above it) does not exist: create it or choose another"),
    _errno.EEXIST: (HostError, "remove {path}, which is in the way, or choose another place"),
    _errno.EISDIR: (HostError, "remove the directory {path}, which is in the way, or choose another place"),
    _errno.ENOTDIR: (HostError, "a part of {path} is a file, not a directory: remove it or choose another place"),
    _errno.ELOOP: (HostError, "{path} is a symbolic link h5serve will not follow: remove it"),
}


def host_error(exc: BaseException, doing: str, fix: str = "") -> HostError:
    """The HostError for an ``OSError`` or ``zmq.ZMQError`` (anything with ``errno`` and
    ``strerror``) met while ``doing`` (e.g. "binding ipc:///run/h5serve/h5serve.sock"): the
    class by errno, a message naming what failed, the OS's reason and ``fix`` (default: the
    errno's usual remedy). Raise it ``from exc``."""
    code = getattr(exc, "errno", None)
    reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    path = getattr(exc, "filename", None)
    cls, remedy = _BY_ERRNO.get(code, (HostError, "")) if isinstance(code, int) else (HostError, "")
    remedy = fix or remedy.format(path=path or "it") or "check the path and this user's rights, then try again"
    where = f" ({path})" if path and str(path) not in doing else ""
    return cls(f"{doing}{where} failed: {reason}; {remedy}")
