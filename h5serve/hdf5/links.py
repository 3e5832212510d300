"""Following a key through soft and external links to the dataset it names, one path
component at a time (so a link behind another link is seen too), and the one other file an
external link may lead to: h5serve tracks a single linked file for changes.

Every failure is a KeyNotFound or UnsupportedDataset naming the link and its target (a
SourceChanged when a path changes while it is resolved; a DataError when the key's link is
there but HDF5 cannot open the object it leads to: the file is damaged).
"""

from __future__ import annotations

import os

import h5py

from ..errors import DataError, KeyNotFound, SourceChanged, UnsupportedDataset

__all__ = ["MAX_LINKS", "dataset_names", "follow"]

MAX_LINKS = 40  # soft and external links followed for one key before it is called a cycle


def dataset_names(f: h5py.File, limit: int = 30) -> list[str]:
    """The paths of the first ``limit`` datasets in ``f`` (HDF5's visiting order)."""
    names: list[str] = []

    def visit(name: str, obj: object) -> None:
        if isinstance(obj, h5py.Dataset) and len(names) < limit:
            names.append(name)

    f.visititems(visit)
    return names


def _realpath(path: str) -> str:
    """``os.path.realpath``, which fails (EINVAL) when a symlink on the way is swapped for a
    file while it resolves. Raised then: SourceChanged."""
    try:
        return os.path.realpath(path)
    except OSError as exc:
        raise SourceChanged(f"{path} changed while its links were followed; request it again") from exc


def _message(exc: BaseException) -> str:
    """An h5py error's text, without the quotes KeyError adds."""
    return str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)


def _split(path: str) -> list[str]:
    return [part for part in path.split("/") if part not in ("", ".")]


def _external_candidates(link_file: str, parent: str) -> set[str]:
    """Realpaths HDF5 may open for an external link to ``link_file`` from the file ``parent``:
    the absolute name, else the name (or, for an absolute one that is missing, its last
    component) under HDF5_EXT_PREFIX, the parent file's directory or the working directory."""
    names = [link_file] if not os.path.isabs(link_file) else [os.path.basename(link_file)]
    parent_dirs = [os.path.dirname(parent), os.path.dirname(_realpath(parent))]
    prefixes = [p for p in os.environ.get("HDF5_EXT_PREFIX", "").split(":") if p]
    dirs = [d for p in prefixes for d in ([p] if p != "${ORIGIN}" else parent_dirs)] + parent_dirs
    try:
        dirs.append(os.getcwd())
    except OSError:  # the working directory was removed: HDF5 cannot have looked there either
        pass
    found = {_realpath(os.path.join(d, name)) for d in dirs for name in names}
    if os.path.isabs(link_file):
        found.add(_realpath(link_file))
    return found


class _FileName:
    """The base name of the file holding ``node``, looked up only when formatted."""

    def __init__(self, node: h5py.HLObject) -> None:
        self.node = node

    def __format__(self, spec: str) -> str:
        return format(os.path.basename(self.node.file.filename), spec)


def _damaged(key: str, filename: str, what: str, exc: BaseException) -> DataError:
    return DataError(f"key {key!r} in {filename}: {what} ({_message(exc)}): the file is damaged; restore it from a "
                     "good copy or write it again (h5dump shows what can still be read)")


def follow(f: h5py.File, key: str) -> tuple[h5py.HLObject, str]:
    """The object at ``key`` and the realpath of the other file holding it ("" if none),
    following soft and external links one path component at a time, so that a link behind
    another link is seen too.

    Raised when the key, or a link's target on its path, does not exist: KeyNotFound.
    Raised when an object on its path exists (a hard link names it) but cannot be opened:
    DataError (the file is damaged).
    Raised when external links pass through more than one other file (h5serve tracks one
    linked file for changes), or through a file h5serve cannot tell: UnsupportedDataset.
    """
    node: h5py.HLObject = f["/"]
    parts = _split(key)
    via: list[str] = []  # the links followed so far, for messages
    files: list[str] = []  # realpaths of the files external links opened, in order

    def broken(what: str, missing: bool = False) -> KeyNotFound:
        if missing and not via:
            names = dataset_names(f)
            return KeyNotFound(
                f"key {key!r} is not in {f.filename}; datasets there: {', '.join(names) or '(none)'}"
            )
        through = f" (reached through {', then '.join(via)})" if via else ""
        return KeyNotFound(f"key {key!r} cannot be opened in {f.filename}: {what}{through}")

    while parts:
        name = parts.pop(0)
        here = f"{node.name.rstrip('/')}/{name}"
        where = _FileName(node)  # formatted only into messages: node.file costs ~0.1 ms
        if not isinstance(node, h5py.Group):
            raise broken(f"{node.name!r} in {where} is not a group")
        try:
            link = node.get(name, getlink=True)
        except (KeyError, ValueError, TypeError, OSError) as exc:  # user-defined links, bad names
            raise broken(f"{here!r} in {where} cannot be read: {_message(exc)}") from exc
        if link is None:
            raise broken(f"{here!r} does not exist in {where}", missing=True)
        if isinstance(link, (h5py.SoftLink, h5py.ExternalLink)) and len(via) >= MAX_LINKS:
            raise broken(f"more than {MAX_LINKS} links followed (a cycle?)")
        if isinstance(link, h5py.SoftLink):
            via.append(f"soft link {here!r} -> {link.path!r} in {where}")
            node = node.file["/"] if link.path.startswith("/") else node
            parts = _split(link.path) + parts
            continue
        try:
            target = node[name]
        except (KeyError, ValueError, OSError) as exc:
            if isinstance(link, h5py.ExternalLink):
                raise broken(
                    f"{here!r} in {where} is an external link to {link.path!r} in file {link.filename!r}, "
                    f"which cannot be opened ({_message(exc)})"
                ) from exc
            if isinstance(link, h5py.HardLink):  # the object is there, HDF5 cannot read it
                raise _damaged(key, f.filename, f"{here!r} in {where} exists but cannot be opened", exc) from exc
            raise broken(f"{here!r} in {where} cannot be opened: {_message(exc)}") from exc
        if isinstance(link, h5py.ExternalLink):
            opened = _realpath(target.file.filename)
            if opened not in _external_candidates(link.filename, node.file.filename):
                raise UnsupportedDataset(
                    f"key {key!r} in {f.filename} goes through external link {here!r} -> {link.filename!r}, "
                    f"which leads on to another file ({opened}); h5serve can track only one linked file for "
                    "changes: link straight to the file that holds the data"
                )
            via.append(f"external link {here!r} -> {link.path!r} in {link.filename!r}")
            files.append(opened)
            node = target.file["/"]
            parts = _split(link.path) + parts
            continue
        node = target
    if not files:  # no external link followed: the object is in f itself
        return node, ""
    outer = _realpath(f.filename)
    others = sorted({path for path in files if path != outer})
    if len(others) > 1:
        raise UnsupportedDataset(
            f"key {key!r} in {f.filename} goes through external links in {len(others)} other files "
            f"({', '.join(others)}); h5serve can track only one linked file for changes: link straight to "
            "the file that holds the data"
        )
    holder = _realpath(node.file.filename)
    if others and holder != others[0]:  # through another file and back: that file is not tracked
        raise UnsupportedDataset(
            f"key {key!r} in {f.filename} goes through an external link in {others[0]} back to {holder}; "
            "h5serve can track only the file that holds the data for changes: link straight to it"
        )
    return node, "" if holder == outer else holder
