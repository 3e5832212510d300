"""Every change the daemon's loaders make to their own process beyond their objects, in one
place, each with why and what it depends on (the client's are in h5serve/client/_process.py):

- ``drop_forkserver_alive_fd``: a loader closes its inherited copy of the forkserver's
  "alive" pipe;
- ``set_pdeathsig``: a loader (or one of its part children) is SIGKILLed when its parent dies;
- ``set_process_name``: a loader shows as ``h5serve-load`` (a spare waiting for its job as
  ``h5serve-spare``) in ps, top and /proc/PID/comm;
- ``quiet_blas``: the daemon and its forkserver start numpy with one OpenBLAS thread.
"""

from __future__ import annotations

import ctypes
import os
import signal

__all__ = ["drop_forkserver_alive_fd", "set_pdeathsig", "set_process_name", "quiet_blas", "SPARE_NAME",
           "LOADER_NAME"]

_PR_SET_PDEATHSIG = 1  # prctl options (linux/prctl.h)
_PR_SET_NAME = 15
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
