"""The source file a loader kept for successive stream blocks (streamloader.py) holds open
between its loads: opened and checked as ``loader.open_source`` opens a source (the daemon's
resolved device and inode, fstat of HDF5's own descriptor), again whenever a job names another
identity. Below both the loader, which reads through it, and the kept loader's job loop.
"""

from __future__ import annotations

import h5py

from ...hdf5.identity import open_h5_verified
from ...hdf5.rawcopy import StoredRows
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
