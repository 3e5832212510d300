"""What resolving a request found (resolve.py does it, off the control loop): one file as
opened and checked with its dataset's metadata (``Resolved``), or every file of a multi-file
request (``ResolvedFiles``). Plain records: the store builds a segment's metadata from them
(fileset.py for many files) without importing the resolver, and a loader never loads it."""

from __future__ import annotations

from dataclasses import dataclass

from ...hdf5.identity import FileIdentity
from ...hdf5.remote import RemoteIdentity
from ...hdf5.source import DatasetInfo

__all__ = ["Resolved", "ResolvedFiles"]


@dataclass(frozen=True)
class Resolved:
    """A request's file as opened and checked, and its dataset's metadata."""

    ident: FileIdentity
    info: DatasetInfo
    linked: FileIdentity | None  # the externally linked file holding the rows, if any
    sources: tuple[FileIdentity, ...] = ()  # a virtual dataset's source files (other than this one)
    # an s3:// object (``ident``: its URL and size, dev, ino and times 0): its ETag and version as looked up
    remote: RemoteIdentity | None = None


@dataclass(frozen=True)
class ResolvedFiles:
    """Every file of a multi-file request, each resolved as one file is, in row order."""

    members: tuple[Resolved, ...]
