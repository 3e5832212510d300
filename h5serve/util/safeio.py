"""Opening files and directories that other users may have planted or swapped.

The rules, after OpenSSH and PostgreSQL: never follow a symlink at the last component
(``O_NOFOLLOW``), never block on a FIFO or device (``O_NONBLOCK``, then ``fstat``), check
the owner and type of what was *opened* (``fstat``), not of a path looked up before, and
create files with ``O_EXCL`` relative to a directory descriptor that was itself checked.

Every function takes ``error``, the H5ServeError subclass to raise, so each caller reports a
refusal in its own terms (a client's untrusted runtime dir is DaemonUnavailable, a daemon's
is ConfigError, a foreign segment is SegmentError).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Collection
from dataclasses import dataclass

from ..errors import H5ServeError, OutOfResources, host_error

__all__ = [
    "NOFOLLOW_FLAGS",
    "describe_owner",
    "describe_file",
    "is_own_file",
    "check_dir_stat",
    "open_dir",
    "open_regular",
    "read_small",
    "remove_if",
    "FlockEntry",
    "flocks",
]

# Added to every open of a file someone else could have put there.
NOFOLLOW_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_MAX_SMALL = 64 * 1024


def describe_owner(uid: int) -> str:
    """``uid 1000 (alice)``, or ``uid 1000`` when there is no such user."""
    import pwd

    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def is_own_file(st: os.stat_result, owner: int | None = None) -> bool:
    """True when ``st`` (an lstat or fstat) is a regular file of ``owner`` (default: our euid):
    the only kind of file under a segment prefix that the daemon reads, evicts or removes
    (segments/, daemon/store/leftovers.py)."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == (os.geteuid() if owner is None else owner)


def describe_file(st: os.stat_result) -> str:
    """``a FIFO of uid 1001 (mallory)``: what sits at a path, for log and error messages."""
    kinds = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a file"))
    kind = next((text for test, text in kinds if test(st.st_mode)), "a device")
    return f"{kind} of {describe_owner(st.st_uid)}"


def _owners_text(owners: Collection[int]) -> str:
    return " or ".join(describe_owner(u) for u in sorted(owners))


def check_dir_stat(st: os.stat_result, path: os.PathLike[str] | str, owners: Collection[int],
                   error: type[H5ServeError], hint: str = "") -> None:
    """Raised unless ``st`` (an ``lstat``/``fstat`` of ``path``) is a directory, not a symlink,
    owned by one of ``owners`` and writable by nobody else: ``error``."""
    tail = f"; {hint}" if hint else ""
    if stat.S_ISLNK(st.st_mode):
        raise error(f"{path} is a symbolic link: refusing to use it{tail}")
    if not stat.S_ISDIR(st.st_mode):
        raise error(f"{path} is not a directory{tail}")
    if st.st_uid not in owners:
        raise error(f"{path} belongs to {describe_owner(st.st_uid)}, not to {_owners_text(owners)}{tail}")
    if stat.S_IMODE(st.st_mode) & 0o022:
        raise error(f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}){tail}")


def open_dir(path: os.PathLike[str] | str, owners: Collection[int], error: type[H5ServeError],
             hint: str = "", dir_fd: int | None = None) -> int:
    """A descriptor of the directory ``path`` (no symlink at its last component), checked as
    ``check_dir_stat`` does on the opened directory itself.

    Raised when it is missing, a symlink, someone else's or writable by others: ``error``.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        _raise_if_out_of_resources(exc, f"opening directory {path}")
        try:
            st = os.lstat(path, dir_fd=dir_fd)
        except OSError:
            st = None
        if st is not None and not stat.S_ISDIR(st.st_mode):
            check_dir_stat(st, path, owners, error, hint)  # says symlink / not a directory
        raise error(f"cannot open directory {path}: {exc.strerror}" + (f"; {hint}" if hint else "")) from exc
    try:
        check_dir_stat(os.fstat(fd), path, owners, error, hint)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(path: os.PathLike[str] | str, error: type[H5ServeError], *, owners: Collection[int] | None = None,
                 flags: int = os.O_RDONLY, create_mode: int | None = None, dir_fd: int | None = None,
                 hint: str = "") -> tuple[int, os.stat_result]:
    """Open ``path`` without following a symlink or blocking on a FIFO; ``(fd, fstat)``.
    With ``create_mode`` the file is created (``O_CREAT | O_EXCL``: it must not exist yet).

    Raised when it is not a regular file, or not owned by one of ``owners`` (when given), or
    cannot be opened: ``error`` (FileNotFoundError's errno is kept in the message).
    """
    all_flags = flags | NOFOLLOW_FLAGS
    if create_mode is not None:
        all_flags |= os.O_CREAT | os.O_EXCL
    tail = f"; {hint}" if hint else ""
    try:
        fd = os.open(path, all_flags, 0o600 if create_mode is None else create_mode, dir_fd=dir_fd)
    except OSError as exc:
        _raise_if_out_of_resources(exc, f"opening {path}")
        why = "it is a symbolic link" if exc.errno == 40 else exc.strerror  # ELOOP from O_NOFOLLOW
        raise error(f"cannot open {path}: {why}{tail}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path} is not a regular file: refusing to use it{tail}")
        if owners is not None and st.st_uid not in owners:
            raise error(f"{path} belongs to {describe_owner(st.st_uid)}, not to {_owners_text(owners)}{tail}")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _raise_if_out_of_resources(exc: OSError, doing: str) -> None:
    """No open files, memory or space left is the machine's problem, not the file's: say so
    (the caller's ``error`` would blame the path)."""
    mapped = host_error(exc, doing)
    if isinstance(mapped, OutOfResources):
        raise mapped from exc


def read_small(fd: int, limit: int = _MAX_SMALL) -> bytes:
    """Up to ``limit`` bytes from the start of an opened regular file (pidfiles, keys)."""
    return os.pread(fd, limit, 0)


def remove_if(path: os.PathLike[str] | str, keep: Callable[[os.stat_result], bool] | None = None) -> bool:
    """Unlink ``path`` unless ``keep(lstat)`` says not to; True when it is gone. Never raises
    for a file that vanished or that we may not remove (another user's, in a sticky dir)."""
    try:
        st = os.lstat(path)
        if keep is not None and keep(st):
            return False
        os.unlink(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class FlockEntry:
    """One ``flock`` lock from /proc/locks: who holds it (``pid``: the process that took it),
    how (``exclusive``), on which file (``dev``, ``ino`` as ``os.stat`` gives them)."""

    pid: int
    exclusive: bool
    dev: int
    ino: int


def flocks() -> list[FlockEntry]:
    """Every ``flock`` lock on the machine, from /proc/locks ([] where it cannot be read: not
    Linux, or /proc hidden)."""
    try:
        with open("/proc/locks") as f:
            lines = f.readlines()
    except OSError:
        return []
    entries = []
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK" or fields[3] not in ("READ", "WRITE"):
            continue
        try:
            major, minor, inode = fields[5].split(":")
            entries.append(FlockEntry(int(fields[4]), fields[3] == "WRITE",
                                      os.makedev(int(major, 16), int(minor, 16)), int(inode)))
        except ValueError:
            continue
    return entries
