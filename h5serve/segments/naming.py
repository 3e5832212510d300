"""Where segments live and whose they are: the published name (keyed by the daemon's secret, so
nobody can compute it and plant a file first), the prefix every segment of one daemon shares,
temporary names (with the pid that created them), and which files under a prefix are ours.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
from typing import TYPE_CHECKING

import msgpack

from ..safeio import describe_owner

if TYPE_CHECKING:
    from .format import SegmentMeta

__all__ = [
    "SECRET_BYTES",
    "TMP_MARK",
    "segment_prefix",
    "segment_name",
    "is_own_file",
    "describe_file",
    "temporary_name",
    "temporary_owner_pid",
]

SECRET_BYTES = 32  # the daemon's naming key (blake2b takes up to 64)
TMP_MARK = ".tmp-"


def segment_prefix(namespace: str) -> str:
    """Every segment of one daemon (uid + runtime-dir namespace) starts with this: public,
    so that the SLURM epilog can find what a killed daemon left behind."""
    return f"h5serve-{os.getuid()}-{namespace}-"


def segment_name(namespace: str, meta: SegmentMeta, secret: bytes) -> str:
    """The published name of the segment holding ``meta``. The part after the prefix is keyed
    by the daemon's ``secret``, so nobody can compute a name from ``stat()`` of the data file
    and plant a file there before the daemon publishes it."""
    if not 16 <= len(secret) <= 64:
        raise ValueError(f"a segment naming secret has 16..64 bytes, got {len(secret)}")
    digest = hashlib.blake2b(msgpack.packb(list(meta.identity())), digest_size=12, key=secret).hexdigest()
    return segment_prefix(namespace) + digest


def is_own_file(st: os.stat_result, owner: int | None = None) -> bool:
    """True when ``st`` (an lstat or fstat) is a regular file of ``owner`` (default: our euid):
    the only kind of file under a segment prefix that the daemon reads, evicts or removes."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == (os.geteuid() if owner is None else owner)


def describe_file(st: os.stat_result) -> str:
    """``a FIFO of uid 1001 (mallory)``: what sits at a path, for log and error messages."""
    kinds = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a file"))
    kind = next((text for test, text in kinds if test(st.st_mode)), "a device")
    return f"{kind} of {describe_owner(st.st_uid)}"


def temporary_name(name: str) -> str:
    return f"{name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(3)}"


def temporary_owner_pid(filename: str) -> int | None:
    """The pid that created a temporary segment file, or None if it is not a temporary."""
    if TMP_MARK not in filename:
        return None
    try:
        return int(filename.rsplit(TMP_MARK, 1)[1].split("-", 1)[0])
    except ValueError:
        return None
