"""H5Handle: an h5py file opened once per process, never pickled, never used across a fork;
the lazy, stream and compat readers read through it."""

from __future__ import annotations

import os
from typing import Any

import h5py

from ...errors import SourceChanged
from ...hdf5.compound import rows_dataset
from ...hdf5.identity import open_h5, open_remote_h5
from ...hdf5.rawcopy import StoredRows, stored_rows
from ...hdf5.remote import RemoteIdentity, is_url
from ...hdf5.source import DatasetInfo
from .. import _process

__all__ = ["H5Handle"]


class H5Handle:
    """An h5py file opened once per process (keyed on pid), never pickled; its dataset
    objects are kept too (looking one up costs ~40 us, more than gathering a batch), and
    where their rows sit in the file (rawcopy: read without HDF5 when stored as numpy holds them).
    A URL is opened through hdf5/remote.py, checked to be ``pin`` (its identity when the dataset
    described it) at every open: SourceChanged once the object was rewritten."""

    def __init__(self, path: str, options: dict[str, Any], pin: RemoteIdentity | None = None) -> None:
        self.path = path
        self.options = options
        self.pin = pin
        self._pid = -1
        self._file: h5py.File | None = None
        self._datasets: dict[str, h5py.Dataset] = {}
        self._stored: dict[str, StoredRows | None] = {}
        self._identity: dict[str, tuple[int, int, int]] = {}  # key -> (fd, size, mtime) of the file holding it

    def file(self) -> h5py.File:
        if self._pid != os.getpid():
            self._file = None  # inherited across fork: never use or close the parent's handle
            self._datasets, self._stored, self._identity = {}, {}, {}
        if self._file is None:
            if is_url(self.path):
                self._file = open_remote_h5(self.path, self.pin, **self.options)[0]
                _process.close_at_exit(self)  # closed before the interpreter finalizes (why: _process.py)
            else:
                self._file = open_h5(self.path, **self.options)
            self._pid = os.getpid()
        return self._file

    def dataset(self, key: str) -> h5py.Dataset:
        """``key`` in this process's open file, ready to read.

        Raised when the file holding it was truncated or rewritten in place since this
        process opened it (HDF5 would read zeros past a new end of file): SourceChanged.
        """
        f = self.file()  # after a fork: reopened, and the parent's dataset objects forgotten
        if key not in self._datasets:
            dset = self._datasets[key] = rows_dataset(f, key)
            if dset.file.driver == "sec2":
                fd = dset.file.id.get_vfd_handle()
                st = os.fstat(fd)
                self._identity[key] = (fd, st.st_size, st.st_mtime_ns)
        elif key in self._identity:
            fd, size, mtime = self._identity[key]
            st = os.fstat(fd)
            if (st.st_size, st.st_mtime_ns) != (size, mtime):
                raise SourceChanged(
                    f"{self._datasets[key].file.filename} changed while this process was reading it (size "
                    f"{size} -> {st.st_size} bytes): it was truncated or rewritten in place; restart the job to "
                    "read the new file, and replace files by writing a new one and renaming it over the old"
                )
        return self._datasets[key]

    def located(self, info: DatasetInfo) -> tuple[h5py.Dataset, StoredRows | None]:
        """``dataset(info.key)`` and where its rows are in this process's open file (None: read
        them through h5py).

        Raised as ``dataset`` is: SourceChanged.
        """
        dset = self.dataset(info.key)
        if info.key not in self._stored:
            self._stored[info.key] = stored_rows(dset, info, info.dtype)
        return dset, self._stored[info.key]

    def drop_inherited(self) -> None:
        if self._pid != os.getpid():
            self._file = None
            self._datasets, self._stored, self._identity = {}, {}, {}

    def close(self) -> None:
        self._datasets, self._stored, self._identity = {}, {}, {}
        if self._file is not None and self._pid == os.getpid():
            self._file.close()
        self._file = None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "options": self.options, "pin": self.pin, "_pid": -1, "_file": None,
                "_datasets": {}, "_stored": {}, "_identity": {}}
