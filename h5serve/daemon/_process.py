"""Every change the daemon and its loaders make to their own process beyond their objects, in
one place, each with why and what it depends on (the client's are in h5serve/client/_process.py):

- ``set_undumpable``: the daemon is not dumpable (no process of its own user can ptrace it or
  read its memory), and neither is any Python it starts (``clean_preparation``: the forkserver and
  the resource tracker; loaders, spares, inspectors and part processes are forked from the
  forkserver and inherit it). They all share the daemon's process group;
- ``start_from_root``: the daemon works from ``/`` with no implicit working-directory or script
  directory entry on ``sys.path``, and every Python it starts (the forkserver) does too;
- ``LoaderContext``: loaders are started (``clean_preparation``) with preparation data that
  never names the daemon's main module (it is not imported again in them), ``sys.path`` without
  implicit entries and ``/`` as their directory; each loader's stderr goes into a file of its
  own (``loader_output``);
- ``drop_forkserver_alive_fd``: a loader closes its inherited copy of the forkserver's
  "alive" pipe;
- ``set_pdeathsig``: a loader (or one of its part children) is SIGKILLed when its parent dies;
- ``set_process_name``: a loader shows as ``h5serve-load`` (a spare waiting for its job as
  ``h5serve-spare``, a loader kept for the next stream block as ``h5serve-kept``) in ps, top
  and /proc/PID/comm;
- ``quiet_blas``: the daemon and its forkserver start numpy with one OpenBLAS thread;
- ``no_hdf5_file_locking``: HDF5 in the forkserver and everything it starts (loaders, part
  processes, inspectors) takes no file lock, on any file it opens;
- ``unshare_inherited_pages``: a spare, while it waits, takes private copies of the memory it
  shares copy-on-write with the forkserver.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from multiprocessing import context, popen_forkserver, reduction, spawn, util
from typing import Any

__all__ = ["drop_forkserver_alive_fd", "set_pdeathsig", "set_process_name", "set_undumpable", "quiet_blas",
           "unshare_inherited_pages", "SPARE_NAME", "LOADER_NAME", "KEPT_NAME", "start_from_root", "safe_sys_path",
           "package_root", "LoaderContext", "LoaderProcess", "loader_output", "clean_preparation",
           "SAFE_PYTHON_FLAGS", "OUTPUT_TAIL_BYTES", "safe_python_env", "SAFE_DIR", "no_hdf5_file_locking"]

_PR_SET_PDEATHSIG = 1  # prctl options (linux/prctl.h)
_PR_GET_DUMPABLE = 3
_PR_SET_DUMPABLE = 4
_PR_SET_NAME = 15
_MADV_POPULATE_WRITE = 23  # linux/mman.h, Linux 5.14
_PAGEMAP_PRESENT = 1 << 63  # Documentation/admin-guide/mm/pagemap.rst
_PAGEMAP_EXCLUSIVE = 1 << 56
_UNSHARE_STEP_BYTES = 1 << 20  # between two looks at whether a job came
_UNSHARE_MAX_MAPPING = 1 << 30  # larger writable mappings are no interpreter's heap: left alone
LOADER_NAME = "h5serve-load"
SPARE_NAME = "h5serve-spare"
KEPT_NAME = "h5serve-kept"  # a loader kept between stream blocks (loaderpool.py), waiting


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


def set_undumpable() -> None:
    """Make this process not dumpable (``prctl(PR_SET_DUMPABLE, 0)``): no core dump, and no
    process without CAP_SYS_PTRACE, its own user's included, may ptrace it, read its memory,
    environment or descriptors (the kernel makes its /proc/PID entries root's).

    Why: a daemon started by root with ``--user`` (a SLURM prolog's, kept between jobs) runs
    outside every job's cgroup and lives on after them; a job of its user that could inject code
    into it would run there, unaccounted, after the job ended. The kernel clears dumpable when
    root drops to the user only with ``fs.suid_dumpable=0``, and an ``execve`` by the user (the
    daemonized ``python -m h5serve.daemon``; a daemon the user starts itself) sets it again: so
    it is set here, at the daemon's start, once it runs as its final user and before it reads
    its secret or opens anything. Version: Linux ``prctl``; a no-op where libc has none.
    """
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _dumpable() -> bool:
    try:
        return bool(ctypes.CDLL(None, use_errno=True).prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0))
    except (OSError, AttributeError):
        return True


# run first by each Python an undumpable process starts through multiprocessing (``_swapped_preparation``)
_UNDUMPABLE_PROLOGUE = (
    "try:\n"
    "    import ctypes\n"
    f"    ctypes.CDLL(None).prctl({_PR_SET_DUMPABLE}, 0, 0, 0, 0)\n"
    "except Exception:\n"
    "    pass\n"
)


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


def no_hdf5_file_locking(env: os._Environ[str] | dict[str, str]) -> None:
    """Tell HDF5 in every process started with ``env`` to take no file lock
    (``HDF5_USE_FILE_LOCKING=FALSE``, whatever it was).

    Why: HDF5 takes a shared ``flock`` on each file it opens and fails the open while another
    process holds an exclusive one, which anyone who can read the file can take (``flock FILE
    sleep 600``): a member of ``--group`` would fail every load of another member's file. The
    daemon's own opens already ask for no lock (hdf5/identity.py ``open_h5_verified``); this
    also covers the files HDF5 opens by itself (external link targets, virtual sources) and
    HDF5 versions without that option. Version: HDF5 reads the variable once, when the library
    starts (1.10.1 and later): it must be set before the forkserver imports h5py.
    """
    env["HDF5_USE_FILE_LOCKING"] = "FALSE"


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


SAFE_DIR = "/"
# -P (Python >= 3.11): no implicit entry (the script's directory, or the working directory for
# -m and -c) first on sys.path. Earlier versions have no such flag: there the child starts in
# SAFE_DIR, so the implicit entry is "/", writable by root only.
SAFE_PYTHON_FLAGS: tuple[str, ...] = ("-P",) if sys.version_info >= (3, 11) else ()
OUTPUT_TAIL_BYTES = 4096  # of a loader's stderr, logged when it exits


def package_root() -> str:
    """The directory h5serve itself was imported from (the parent of the package)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _implicit_entries() -> set[str]:
    """The absolute paths sys.path may hold without anyone having configured them: the working
    directory (now and when multiprocessing was imported) and the main script's directory.
    Entries of $PYTHONPATH (configuration of whoever started the daemon) and the directory
    h5serve was imported from (the code already trusted) are never among them."""
    from multiprocessing import process

    found = {os.getcwd(), os.path.realpath(os.getcwd())}
    original = getattr(process, "ORIGINAL_DIR", None)  # the working directory when multiprocessing was imported
    if original:
        found.add(original)
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file:
        script_dir = os.path.dirname(os.path.abspath(main_file))
        found |= {script_dir, os.path.realpath(script_dir)}
    explicit = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    return found - explicit - {package_root()}


def safe_sys_path(path: list[str]) -> list[str]:
    """``path`` without ``''`` and without the implicit entries (``_implicit_entries``)."""
    implicit = _implicit_entries()
    return [p for p in path if p and os.path.abspath(p) not in implicit]


def start_from_root() -> None:
    """Make this process (the daemon) work from ``/``, drop the implicit entries from its
    ``sys.path``, and have every Python it starts do the same.

    Why: ``h5serve start`` in a directory another user can write would otherwise import their
    ``msgpack.py`` (or numpy.py, zmq.py, ...) in the daemon, its forkserver (started with
    ``python -c``: ``''`` first on its path) and its loaders (handed the daemon's ``sys.path``
    and working directory by multiprocessing), as the daemon's user. Modules already imported
    stay what they are: run ``h5serve`` (its console script) or ``python -P -m h5serve``.
    Version: PYTHONSAFEPATH is read by Python >= 3.11; earlier ones start in ``/``.
    """
    from multiprocessing import process

    sys.path[:] = safe_sys_path(sys.path)
    os.chdir(SAFE_DIR)
    process.ORIGINAL_DIR = SAFE_DIR  # type: ignore[attr-defined]  # multiprocessing puts it for '' and relative main paths
    safe_python_env(os.environ)


def safe_python_env(env: os._Environ[str] | dict[str, str]) -> None:
    """Ask every Python started with ``env`` for no implicit first entry on its ``sys.path``
    (``PYTHONSAFEPATH``, read by Python >= 3.11; the forkserver is started with ``python -c``,
    which would otherwise put its working directory first)."""
    env["PYTHONSAFEPATH"] = "1"


@contextlib.contextmanager
def clean_preparation() -> Iterator[None]:
    """While starting a loader (or the forkserver), multiprocessing's preparation data has no
    main module, a ``sys.path`` without implicit entries and ``/`` as the directory; and a Python
    multiprocessing executes (the forkserver, the resource tracker: ``python -c CODE``) from an
    undumpable process (``set_undumpable``) makes itself undumpable before it runs ``CODE``.

    Why: a child of the forkserver imports the parent's ``__main__`` again as ``__mp_main__``
    (``spawn.prepare``) before it runs its target: a script without an ``if __name__ ==
    "__main__":`` guard that runs ``h5serve start --foreground`` started another daemon in every
    loader (which found the first and exited 1), and a main script in a directory another user
    can write is theirs. Loaders need nothing from ``__main__``: their targets are h5serve's.
    Version: ``spawn.get_preparation_data`` is looked up by ``popen_forkserver`` and
    ``forkserver.ensure_running`` at call time (CPython 3.8 to 3.13 at least); it is replaced
    only for the duration of a start. Starts come from the control thread (loaders, spares) and
    from resolver threads (inspectors), so one start at a time holds the swap (a re-entrant lock:
    a start may start the forkserver inside it); unlocked, one thread could restore the original
    while another was launching, and that child would import the main module after all.
    ``execve`` makes a process of the same user dumpable again, so the forkserver (and every
    loader it forks) would be open to ``ptrace`` by the daemon's user without the prologue;
    ``util.spawnv_passfds`` is looked up at call time by ``forkserver`` and ``resource_tracker``
    (CPython 3.8 to 3.13 at least), and both start again from within a launch if they died.
    """
    with _PREPARATION_LOCK:
        yield from _swapped_preparation()


_PREPARATION_LOCK = threading.RLock()


def _swapped_preparation() -> Iterator[None]:
    original = spawn.get_preparation_data
    original_spawnv = util.spawnv_passfds
    undumpable = not _dumpable()

    def spawnv(path: Any, args: Any, passfds: Any) -> int:
        args = list(args)
        if undumpable and len(args) >= 2 and args[-2] == "-c":
            args[-1] = _UNDUMPABLE_PROLOGUE + args[-1]
        return int(original_spawnv(path, args, passfds))

    def prepared(name: str) -> dict[str, Any]:
        data = dict(original(name))
        for key in ("init_main_from_path", "init_main_from_name", "main_path"):
            data.pop(key, None)
        data.update(sys_path=safe_sys_path(list(data.get("sys_path", sys.path))), dir=SAFE_DIR, orig_dir=SAFE_DIR)
        return data

    spawn.get_preparation_data = prepared
    util.spawnv_passfds = spawnv
    try:
        yield
    finally:
        spawn.get_preparation_data = original
        util.spawnv_passfds = original_spawnv


class _LoaderPopen(popen_forkserver.Popen):
    def _launch(self, process_obj: Any) -> None:
        with clean_preparation():
            super()._launch(process_obj)  # type: ignore[misc]


class _Output:
    """A loader's stderr: an anonymous file the daemon reads once the loader is done. Pickled
    to the child as a descriptor the forkserver hands over (like a Connection)."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("h5serve-loader-stderr", os.MFD_CLOEXEC)
        self._close = weakref.finalize(self, os.close, self.fd)
        self._child: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"child": reduction.DupFd(self.fd)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.fd, self._child = -1, state["child"]

    def redirect_stderr(self) -> None:
        """In the loader: fd 2 (Python's sys.stderr, faulthandler, C libraries) into the file."""
        fd = self._child.detach()
        os.dup2(fd, 2)
        os.close(fd)

    def tail(self, limit: int = OUTPUT_TAIL_BYTES) -> str:
        try:
            size = os.fstat(self.fd).st_size
            return os.pread(self.fd, limit, max(0, size - limit)).decode(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        self._close()


class LoaderProcess(context.ForkServerProcess):
    """A forkserver child started with ``clean_preparation`` whose stderr is ``loader_output``'s."""

    def start(self) -> None:
        self._output = _Output()
        super().start()

    def run(self) -> None:
        self._output.redirect_stderr()
        super().run()

    def close(self) -> None:
        super().close()
        self._output.close()

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _LoaderPopen(process_obj)


class LoaderContext(context.ForkServerContext):
    Process = LoaderProcess


def loader_output(process: object, lines: int = 20) -> list[str]:
    """The last ``lines`` non-empty lines (of its last ``OUTPUT_TAIL_BYTES``) a loader wrote to
    its stderr, each stripped of control characters (they are logged); [] for a process that is
    no LoaderProcess."""
    output = getattr(process, "_output", None)
    if not isinstance(output, _Output):
        return []
    text = "".join(c if c.isprintable() or c == "\n" else "?" for c in output.tail())
    return [line.rstrip() for line in text.splitlines() if line.strip()][-lines:]
