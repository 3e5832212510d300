"""Where segments live and whose they are: the published name (keyed by the daemon's secret, so
nobody can compute it and plant a file first), the prefix every segment of one daemon shares,
temporary names (with the pid that created them), and which names under a prefix are ours
(whether a file there is a regular file of ours is util/safeio.py's ``is_own_file``).

Every name is visible to every local user (``ls /dev/shm``). A temporary names only its
daemon's public prefix, the loader's pid and 128 random bits: nothing of the segment it will be
published as. A published name, once seen, can be taken by anyone after its segment is evicted
(or the daemon restarts): then the segment is published under ``fresh_name`` of it, the keyed
name with 128 random bits appended, which nobody can guess before it exists.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from typing import TYPE_CHECKING

import msgpack

if TYPE_CHECKING:
    from .format import SegmentMeta

__all__ = [
    "SECRET_BYTES",
    "TMP_MARK",
    "segment_prefix",
    "segment_name",
    "temporary_name",
    "temporary_owner_pid",
    "fresh_name",
    "is_published_as",
]

SECRET_BYTES = 32  # the daemon's naming key (blake2b takes up to 64)
TMP_MARK = "-tmp-"  # after the prefix (which ends in "-"); published names are hex after it
_LEGACY_TMP_MARK = ".tmp-"  # <final>.tmp-<pid>-<rand>, as daemons before issue 21 named them
_RANDOM_BYTES = 16
_TEMPORARY = re.compile(r"[.-]tmp-([0-9]+)-[0-9a-f]+\Z")


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


def temporary_name(namespace: str) -> str:
    """A new temporary's name: ``<prefix>tmp-<pid>-<128 random bits>``. It says whose daemon
    made it (the epilog and the next daemon clean up by prefix) and which process (leftovers),
    never which segment it becomes: nobody can learn a final name from it and take it first."""
    return f"{segment_prefix(namespace)}{TMP_MARK[1:]}{os.getpid()}-{secrets.token_hex(_RANDOM_BYTES)}"


def temporary_owner_pid(filename: str) -> int | None:
    """The pid that created a temporary segment file, or None if it is not a temporary (this
    daemon's names, and the ``<final>.tmp-<pid>-<rand>`` of earlier versions)."""
    found = _TEMPORARY.search(filename)
    return int(found.group(1)) if found else None


def fresh_name(name: str) -> str:
    """Another name for the segment keyed ``name``, when something that is not ours holds
    ``name``: ``<name>-<128 random bits>``."""
    return f"{name}-{secrets.token_hex(_RANDOM_BYTES)}"


def is_published_as(filename: str, name: str) -> bool:
    """Whether ``filename`` is a name the segment keyed ``name`` is published under: ``name``
    itself or a ``fresh_name`` of it."""
    if filename == name:
        return True
    suffix = filename[len(name) + 1:] if filename.startswith(name + "-") else ""
    return len(suffix) == 2 * _RANDOM_BYTES and all(c in "0123456789abcdef" for c in suffix)
