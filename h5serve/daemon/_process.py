"""Every change the daemon's loaders make to their own process beyond their objects, in one
place, each with why and what it depends on (the client's are in h5serve/client/_process.py):

- ``drop_forkserver_alive_fd``: a loader closes its inherited copy of the forkserver's
  "alive" pipe;
- ``set_pdeathsig``: a loader (or one of its part children) is SIGKILLed when its parent dies;
- ``set_process_name``: a loader shows as ``h5serve-load`` (a spare waiting for its job as
  ``h5serve-spare``) in ps, top and /proc/PID/comm;
- ``quiet_blas``: the daemon and its forkserver start numpy with one OpenBLAS thread;
- ``unshare_inherited_pages``: a spare, while it waits, takes private copies of the memory it
  shares copy-on-write with the forkserver.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
from collections.abc import Callable, Iterator

__all__ = ["drop_forkserver_alive_fd", "set_pdeathsig", "set_process_name", "quiet_blas",
           "unshare_inherited_pages", "SPARE_NAME", "LOADER_NAME"]

_PR_SET_PDEATHSIG = 1  # prctl options (linux/prctl.h)
_PR_SET_NAME = 15
_MADV_POPULATE_WRITE = 23  # linux/mman.h, Linux 5.14
_PAGEMAP_PRESENT = 1 << 63  # Documentation/admin-guide/mm/pagemap.rst
_PAGEMAP_EXCLUSIVE = 1 << 56
_UNSHARE_STEP_BYTES = 1 << 20  # between two looks at whether a job came
_UNSHARE_MAX_MAPPING = 1 << 30  # larger writable mappings are no interpreter's heap: left alone
LOADER_NAME = "h5serve-load"
SPARE_NAME = "h5serve-spare"


def drop_forkserver_alive_fd() -> None:
    """Close this process's copy of the forkserver's "alive" pipe.

    Why: the forkserver exits only once every holder of that pipe is gone, and every process
    it forks inherits a copy; a loader holding one would keep the forkserver (and so itself,
    via PDEATHSIG) alive after the daemon died. Version: the pipe is a private attribute of
    CPython's multiprocessing.forkserver (``_forkserver._forkserver_alive_fd``, 3.8 to 3.13 at
    least); where it is missing, nothing is closed and PDEATHSIG plus the daemon's pidfd still
    stop the loader.
    """
    from multiprocessing import forkserver

    alive_fd = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_alive_fd", None)
    if isinstance(alive_fd, int):
        try:
            os.close(alive_fd)
        except OSError:
            pass


def set_pdeathsig() -> None:
    """Ask the kernel to SIGKILL this process when its parent exits.

    Why: a loader (whose parent is the forkserver) or a part child (whose parent is the
    loader) must never go on writing a segment for a daemon that is gone. Version: Linux
    ``prctl(PR_SET_PDEATHSIG)``; a no-op where libc has no ``prctl``.
    """
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def set_process_name(name: str) -> None:
    """Name this process (``/proc/PID/comm``, at most 15 bytes) for ps and top.

    Why: loaders are forkserver children named "python"; an operator (or a test) tells a
    loader at work from a spare waiting for its job by this name. Version: Linux
    ``prctl(PR_SET_NAME)``; a no-op where libc has no ``prctl``.
    """
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def quiet_blas(env: os._Environ[str] | dict[str, str]) -> None:
    """Ask a process started with ``env`` that imports numpy for one OpenBLAS thread, unless
    the environment already says how many.

    Why: OpenBLAS starts a thread per core when numpy is imported, and each spins for ~0.1 s
    (measured with perf on the bench's 2-core VM) before it sleeps: the daemon and its
    forkserver start as a job does (a SLURM prolog), and took a core from its first loads.
    The daemon and its loaders do no linear algebra. Version: OPENBLAS_NUM_THREADS is read
    once, when the library loads; a process that already imported numpy keeps its threads.
    """
    env.setdefault("OPENBLAS_NUM_THREADS", "1")


def _shared_runs() -> Iterator[tuple[int, int]]:
    """``(address, bytes)`` of the runs of pages of this process's private writable mappings
    that are present but not mapped by this process alone: shared copy-on-write with the
    process it was forked from."""
    import numpy as np  # a loader's import (the forkserver preloads it), not the CLI's

    page = os.sysconf("SC_PAGE_SIZE")
    present, exclusive = np.uint64(_PAGEMAP_PRESENT), np.uint64(_PAGEMAP_EXCLUSIVE)
    with open("/proc/self/maps") as lines, open("/proc/self/pagemap", "rb", buffering=0) as entries:
        for line in lines:
            fields = line.split()
            if len(fields) < 2 or fields[1] != "rw-p":
                continue
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if hi - lo > _UNSHARE_MAX_MAPPING:
                continue
            flags = np.frombuffer(os.pread(entries.fileno(), (hi - lo) // page * 8, lo // page * 8), dtype=np.uint64)
            shared = np.flatnonzero(((flags & present) != 0) & ((flags & exclusive) == 0))
            if not len(shared):
                continue
            breaks = np.flatnonzero(np.diff(shared) != 1)
            starts = np.concatenate(([shared[0]], shared[breaks + 1]))
            ends = np.concatenate((shared[breaks], [shared[-1]])) + 1
            for a, b in zip(starts.tolist(), ends.tolist()):
                yield lo + a * page, (b - a) * page


def unshare_inherited_pages(stop: Callable[[], bool]) -> int:
    """Write-fault in (``MADV_POPULATE_WRITE``) every page this process still shares
    copy-on-write with its parent, a MiB at a time, until done or ``stop()`` says so.
    Returns the bytes copied.

    Why: a loader's first milliseconds (creating the segment, opening the file, finding its
    chunks) write into ~1,500 pages it shares with the forkserver, each a copy-on-write fault,
    while its reservation thread runs in ``posix_fallocate`` on the other core. A fault that
    replaces a page another running thread of the process may have cached must flush that
    core's TLB: an interrupt sent and waited for. On the bench's 2-core VM each one costs a
    VM exit on both cores, and together they slowed the reservation by ~5 ms and the loader's
    preparation 2-3x (perf: ``smp_call_function_many_cond``, ``native_write_msr``). A spare
    has nothing else to do while it waits; its pages (~23 MB, copies of what the forkserver
    imported) are then its own and a load starts with ~700 faults, none of them copies.
    ``stop`` lets a job that arrives meanwhile start at once. Version: Linux 5.14; earlier
    kernels refuse the advice (EINVAL) and nothing is copied. ``/proc/self/pagemap`` gives
    every process its own pages' present and exclusive bits (Linux 4.2).
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        runs = list(_shared_runs())
    except (OSError, AttributeError, ValueError):
        return 0
    copied = 0
    for address, size in runs:
        for offset in range(0, size, _UNSHARE_STEP_BYTES):
            if stop():
                return copied
            step = min(_UNSHARE_STEP_BYTES, size - offset)
            if madvise(address + offset, step, _MADV_POPULATE_WRITE) != 0:
                if ctypes.get_errno() == errno.EINVAL:  # a kernel without the advice
                    return copied
                break  # this mapping cannot be populated (gone, or not memory): the next one
            copied += step
    return copied
