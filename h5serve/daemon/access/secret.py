"""The daemon's naming secret: a random key, kept 0600 in its runtime dir as ``h5serve.key``.

Segment names are keyed by it (``segments.segment_name``), so another user cannot compute a
name from ``stat()`` of a data file and plant a file there before the daemon publishes it.
A restarted daemon reads the same key back, so it still recognises (and adopts) the complete
segments a killed one left behind. The key is only ever read by the daemon: clients learn
names from the daemon's replies.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

from ...errors import ConfigError
from ...segments import SECRET_BYTES
from ...util.safeio import NOFOLLOW_FLAGS, describe_file, open_dir, read_small

__all__ = ["KEY_NAME", "load_secret"]

KEY_NAME = "h5serve.key"
log = logging.getLogger("h5serve.daemon")


def load_secret(directory: Path) -> bytes:
    """The key in ``directory`` (the runtime dir, whose pidfile lock the caller holds): read
    back when a valid one is there, else (missing, damaged, someone else's, readable by
    others) created afresh, which only costs the adoption of the previous daemon's segments.

    Raised when the runtime dir is not ours or the key cannot be written: ConfigError.
    """
    dir_fd = open_dir(directory, {os.geteuid()}, ConfigError, hint="choose another --runtime-dir")
    try:
        key = _read_key(dir_fd, directory)
        return key if key is not None else _create_key(dir_fd, directory)
    finally:
        os.close(dir_fd)


def _read_key(dir_fd: int, directory: Path) -> bytes | None:
    """The existing key, or None (after removing whatever is at its name) when it is unusable."""
    try:
        fd = os.open(KEY_NAME, os.O_RDONLY | NOFOLLOW_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:  # a symlink (ELOOP), a socket...
        _discard(dir_fd, directory, exc.strerror or str(exc))
        return None
    try:
        st = os.fstat(fd)
        key = read_small(fd, SECRET_BYTES + 1) if stat.S_ISREG(st.st_mode) else b""
    finally:
        os.close(fd)
    problem = _key_problem(st, key)
    if problem:
        _discard(dir_fd, directory, problem)
        return None
    return key


def _key_problem(st: os.stat_result, key: bytes) -> str:
    """Why the opened key file (``st``, its first bytes ``key``) cannot be used; "" if it can."""
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        return f"it is {describe_file(st)}"
    if stat.S_IMODE(st.st_mode) & 0o077:
        return f"it was readable by others (mode {stat.S_IMODE(st.st_mode):o})"
    if len(key) != SECRET_BYTES:
        return f"it has {len(key)} bytes, not {SECRET_BYTES}"
    return ""


def _discard(dir_fd: int, directory: Path, why: str) -> None:
    log.warning("replacing the naming key %s/%s (%s): segments a previous daemon left are not adopted",
                directory, KEY_NAME, why)
    try:
        os.unlink(KEY_NAME, dir_fd=dir_fd)  # the name, never what a symlink points to
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot remove {directory}/{KEY_NAME}: {exc.strerror}; remove it by hand") from exc


def _create_key(dir_fd: int, directory: Path) -> bytes:
    key = secrets.token_bytes(SECRET_BYTES)
    tmp = f"{KEY_NAME}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW_FLAGS, 0o600, dir_fd=dir_fd)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            if os.write(fd, key) != len(key):
                raise OSError(0, "short write")
            os.fsync(fd)
        finally:
            os.close(fd)
        # Written under a temporary name first, so a crash never leaves a short key behind.
        os.rename(tmp, KEY_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as exc:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise ConfigError(f"cannot create the naming key {directory}/{KEY_NAME}: {exc.strerror}; "
                          "check that the runtime dir is writable by the daemon's user") from exc
    return key
