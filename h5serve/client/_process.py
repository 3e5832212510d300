"""Every change the client makes to the whole process (not just to its own objects), in one
place, each with why it is needed and what it depends on:

- ``register_collate``: h5serve's row types in torch's ``default_collate_fn_map``;
- ``guard_forks``: an at-fork hook giving children of a process that gathered one torch thread;
- ``return_batch_memory``: glibc's ``mallopt`` in DataLoader workers;
- ``close_at_exit``: an atexit hook closing the remote files (hdf5/remote.py) this process opened.

Nothing here runs at import; each is called where its need arises.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

__all__ = ["register_collate", "guard_forks", "fork_guard_registered", "return_batch_memory",
           "WORKER_MMAP_THRESHOLD", "close_at_exit"]

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
WORKER_MMAP_THRESHOLD = 128 * 1024  # glibc's initial value, pinned
fork_guard_registered = False  # read on every gather: a flag check, not a call


def register_collate(handlers: dict[type, Callable[..., Any]]) -> None:
    """Make ``default_collate`` collate samples of each type in ``handlers`` with its function.

    Why: DataLoader's default collate (no ``collate_fn`` given) must return h5serve's whole
    batches as they are and stack its per-sample rows as it stacks tuples. Keyed on h5serve's
    own types only, so nothing else collates differently. Version: ``default_collate_fn_map``
    is torch's documented extension point (the docstring of torch.utils.data's ``collate``)
    since torch 2.0; h5serve requires 2.1, and says so if an older torch lacks it.
    """
    from torch.utils.data._utils import collate

    fn_map = getattr(collate, "default_collate_fn_map", None)
    if not isinstance(fn_map, dict):
        raise ImportError(f"h5serve needs torch >= 2.1 (default_collate_fn_map), found torch {torch.__version__}: "
                          "python -m pip install -U torch")
    fn_map.update(handlers)


def _one_torch_thread() -> None:
    torch.set_num_threads(1)


def guard_forks() -> None:
    """From now on, every child this process ``fork()``s runs torch with one thread.

    Why: once torch's OpenMP pool has started (the samplers' ``torch.randperm`` runs on it for
    shards of 32k rows or more), a forked child hangs in its first parallel torch op (GNU
    OpenMP is not fork-safe; measured with torch 2.x builds). DataLoader does the same for its
    workers. Only children are touched: ``torch.get_num_threads()`` here stays what the user
    set. Version: ``os.register_at_fork`` is POSIX-only (Python >= 3.7); without it there is
    no fork to guard.
    """
    global fork_guard_registered
    if not fork_guard_registered:
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_one_torch_thread)
        fork_guard_registered = True


def return_batch_memory() -> None:
    """Make a worker give each batch's memory back to the system when the batch is freed.

    Why: glibc raises its mmap threshold to the size of the largest block freed, so after the
    first batch every batch (megabytes) comes from the heap, and a worker that has handed out
    an epoch of batches keeps ~100 MB of freed heap it never returns (measured in
    bench/memory.py). Pinning the threshold keeps batch-sized blocks on mmap. Version: glibc
    only (``M_MMAP_THRESHOLD`` is -3 there); a no-op where ``mallopt`` is missing (musl, macOS).
    """
    try:
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, WORKER_MMAP_THRESHOLD)
    except (OSError, AttributeError):
        pass


class _Closable(Protocol):
    def close(self) -> None: ...


_closed_at_exit: weakref.WeakSet[_Closable] = weakref.WeakSet()
_exit_hook_registered = False


def close_at_exit(handle: _Closable) -> None:
    """Close ``handle`` (an H5Handle holding a remote file, client/backends/handle.py) before
    the interpreter finalizes, unless it is closed or gone before.

    Why: an h5py file opened on a Python file object (``h5py.File(RemoteFile)``) that is still
    open when the interpreter finalizes is closed by HDF5 while the modules it calls back into
    (h5serve's file object, fsspec, its event loop thread) are being torn down: a spawned
    DataLoader worker, which exits through a full finalization, died of SIGSEGV at every exit
    (h5py 3.x, fsspec/s3fs 2026.9; tests/integration/test_remote.py). atexit hooks run before
    that teardown, while fsspec's loop thread still runs, and latest first, so this one runs
    before h5py's. H5Handle.close closes only what this process opened (a forked child skips
    its parent's files). Held weakly: a handle closed and dropped earlier is not kept alive.
    """
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_close_all)
        _exit_hook_registered = True
    _closed_at_exit.add(handle)


def _close_all() -> None:
    for handle in list(_closed_at_exit):
        try:
            handle.close()
        except Exception:  # at exit: nothing is left to report to
            pass
