"""What an earlier daemon on the same runtime dir left in the shm dir, after a ``kill -9``:
temporaries of dead loaders are removed, complete segments whose source files are unchanged
are adopted, the rest is removed. Only regular files of this daemon's euid under its prefix
are read or removed: anything else there (another user's file, a symlink, a FIFO) is logged
and left alone, since the prefix is public. ``publish_name`` steers a new segment around a
file that is not ours at its keyed name."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ...errors import H5ServeError
from ...hdf5.identity import identities_unchanged
from ...segments import (
    fresh_name,
    is_published_as,
    read_meta,
    segment_name,
    segment_prefix,
    temporary_owner_pid,
    try_evict,
)
from ...util.logtext import printable
from ...util.safeio import describe_file, is_own_file, remove_if
from .entries import Entry, not_ours

__all__ = ["adopt_leftovers", "own_files", "publish_name"]

log = logging.getLogger("h5serve.daemon")


def own_files(shm_dir: Path, namespace: str) -> list[Path]:
    """This daemon's files in the shm dir: under its prefix, regular, owned by its euid
    (lstat). The prefix is public, so the rest is logged and never touched."""
    prefix = segment_prefix(namespace)
    try:
        names = sorted(n for n in os.listdir(shm_dir) if n.startswith(prefix))
    except OSError as exc:
        log.warning("cannot list %s: %s", printable(shm_dir), exc.strerror)
        return []
    own = []
    for name in names:
        path = shm_dir / name
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if is_own_file(st):
            own.append(path)
        else:
            log.warning("%s is %s, not a segment of this daemon: leaving it alone", printable(path), describe_file(st))
    return own


def adopt_leftovers(shm_dir: Path, namespace: str, secret: bytes) -> list[Entry]:
    """Remove temporaries of dead loaders; the complete segments whose sources are unchanged,
    as ready entries (published under their keyed name or a fresh name of it: one per key);
    remove the rest."""
    adopted: dict[str, Entry] = {}
    for path in own_files(shm_dir, namespace):
        if temporary_owner_pid(path.name) is not None:
            # A live loader holds an exclusive lock on its temporary; a dead one's lock is
            # gone with it (pids in names can be reused or belong to unreaped zombies).
            if try_evict(path):
                log.info("removed %s left by a dead loader", printable(path.name))
            continue
        try:
            meta, complete = read_meta(path)
            unchanged = identities_unchanged(meta.identities())
        except H5ServeError as exc:
            log.info("dropping %s: %s", printable(path.name), printable(exc))
            complete = unchanged = False
        name = segment_name(namespace, meta, secret) if complete and unchanged else ""
        if name and name not in adopted and is_published_as(path.name, name):
            adopted[name] = Entry(name, meta, "ready", file=path.name)
            log.info("adopted %s (%s[%s] %s)", path.name, printable(meta.source_path), printable(meta.key),
                     meta.shard_label())
        else:
            remove_if(path, keep=not_ours)
    return list(adopted.values())


def publish_name(shm_dir: Path, name: str) -> str:
    """The file name to publish the segment keyed ``name`` as: ``name``, unless a file that is
    not ours holds it (someone saw the name and took it after an eviction or a restart): then a
    fresh one (lifecycle.publish also falls back to one if it is taken meanwhile)."""
    try:
        st = os.lstat(shm_dir / name)
    except OSError:
        return name
    if is_own_file(st):  # a leftover of ours: publishing replaces it
        return name
    fresh = fresh_name(name)
    log.warning("%s/%s is %s, not ours (left alone): publishing the segment as %s", printable(shm_dir), name,
                describe_file(st), fresh)
    return fresh
