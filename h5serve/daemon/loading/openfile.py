"""The source file a loader kept for successive stream blocks (streamloader.py) holds open
between its loads: opened and checked as ``loader.open_source`` opens a source (the daemon's
resolved device and inode, fstat of HDF5's own descriptor), again whenever a job names another
identity. Below both the loader, which reads through it, and the kept loader's job loop.

An s3:// object's stream blocks (remoteload.py) keep the object open the same way
(``OpenFile.remote``): its HDF5 metadata (superblock, object headers, the chunk index) read
once per loader through the small metadata block cache, not once per block, and the check of
the fetched rows against h5py's read of them made at a dataset's first block. Opened again
whenever a job names another version (the daemon resolves the object at every request; each
ranged GET is pinned to the job's ETag all the same).
"""

from __future__ import annotations

import h5py

from ...hdf5.identity import open_h5_verified
from ...hdf5.rawcopy import StoredRows
from ...hdf5.remote import METADATA_BLOCK_BYTES, METADATA_CACHE_BLOCKS, RemoteFile, RemoteIdentity, open_remote
from ...segments import SegmentMeta

__all__ = ["OpenFile"]


class OpenFile:
    """The source file a kept loader holds open between its loads."""

    def __init__(self) -> None:
        self._file: h5py.File | None = None
        self._identity: tuple = ()
        # where each dataset's rows are stored in the kept file (hdf5/reads.py), found at its
        # first block: listing a dataset's chunks costs per file, not per block. Forgotten with
        # the file: a file changed in place is a new identity, opened (and listed) again.
        self.places: dict[tuple[str, ...], StoredRows | None] = {}
        self._remote: tuple[RemoteFile, h5py.File] | None = None
        self._remote_identity: tuple = ()
        self.checked: set[str] = set()  # the kept object's datasets whose fetched rows were checked

    def remote(self, meta: SegmentMeta, pin: RemoteIdentity) -> tuple[RemoteFile, h5py.File]:
        """``meta``'s s3:// object (pinned to ``pin``) and HDF5's view of it, opened once per
        version. Raised as ``open_remote`` and ``h5py.File`` are."""
        return self.remote_object(pin, (meta.source, meta.remote))

    def remote_object(self, pin: RemoteIdentity, identity: tuple = ()) -> tuple[RemoteFile, h5py.File]:
        """The s3:// object ``pin`` names, opened pinned to it and kept while ``identity`` (else
        the pin) stays the one asked for. Raised as ``open_remote`` and ``h5py.File`` are."""
        identity = identity or (pin.url, pin.size, pin.etag, pin.version_id)
        if self._remote is None or self._remote_identity != identity:
            self.close()
            fileobj = open_remote(pin.url, pin, block_bytes=METADATA_BLOCK_BYTES, cache_blocks=METADATA_CACHE_BLOCKS)
            try:
                # no chunk cache: the two rows checked (remoteload._check_ends) are read alone, not their chunks
                self._remote = (fileobj, h5py.File(fileobj, "r", rdcc_nbytes=0))
            except BaseException:
                fileobj.close()
                raise
            self._remote_identity = identity
        return self._remote

    def open(self, meta: SegmentMeta) -> h5py.File:
        """``meta``'s source, opened and checked as ``loader.open_source`` does, once per
        identity. Raised as it is."""
        if self._file is None or self._identity != meta.source:
            self.close()
            # without HDF5's shared flock, as every open of the daemon's (open_h5_verified): with
            # it, the file kept open between blocks would make every writer of it fail ("unable
            # to lock file") until this loader exits. The rows read are checked against the
            # file's identity after every load (a write changes its mtime), as in any loader.
            self._file = open_h5_verified((meta.source_path, meta.source_dev, meta.source_ino))
            self._identity = meta.source
        return self._file

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except Exception:  # noqa: BLE001 - closing a read-only handle: nothing to save
                pass
        self._file, self._identity = None, ()
        self.places = {}
        if self._remote is not None:
            fileobj, f = self._remote
            try:
                f.close()
            except Exception:  # noqa: BLE001 - closing a read-only handle: nothing to save
                pass
            fileobj.close()
        self._remote, self._remote_identity = None, ()
        self.checked = set()
