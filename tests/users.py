"""Real other users for security tests: throwaway accounts and groups, acting as them, and a
Python they can run.

The suite runs as root on the project's machines. Each helper here creates what it needs
(``useradd``/``groupadd`` with random names) and removes it in ``finally``; tests that need
them are marked ``root_only`` and skip with the reason elsewhere.

The interpreter running the suite may live where other users cannot read it (here: under
``/root``, mode 0700). ``portable_python`` copies the packages the daemon and the CLI import
(not torch) next to a copy of h5serve in a world-readable directory and runs them with the
system's ``/usr/bin/python3`` of the same minor version, so a throwaway user can run
``h5serve`` and its daemon for real. ``public_interpreter`` gives them the suite's own
interpreter, torch included (bind mounts of its installation and, from a virtualenv, of the
venv's site-packages), for jobs and DataLoader workers started with spawn.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import secrets
import select
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="creating users and switching uids needs root")

REPO = Path(__file__).resolve().parent.parent
# What `python -m h5serve` (CLI, daemon, loaders) imports; torch is client-only.
_PORTABLE_PACKAGES = ("h5py", "h5py.libs", "numpy", "numpy.libs", "zmq", "pyzmq.libs", "msgpack", "tqdm",
                      "hdf5plugin")


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int  # primary group (a group of its own)


@dataclass(frozen=True)
class Group:
    name: str
    gid: int


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=60)


@contextlib.contextmanager
def throwaway_group() -> Iterator[Group]:
    name = f"h5sg{secrets.token_hex(3)}"
    _run("groupadd", name)
    try:
        import grp

        yield Group(name, grp.getgrnam(name).gr_gid)
    finally:
        subprocess.run(["groupdel", name], capture_output=True, timeout=60)


@contextlib.contextmanager
def throwaway_user(groups: tuple[Group, ...] = ()) -> Iterator[User]:
    """A new user with a group of its own, no home, no login shell; in ``groups`` too."""
    name = f"h5su{secrets.token_hex(3)}"
    argv = ["useradd", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin", "--home-dir", "/nonexistent"]
    if groups:
        argv += ["--groups", ",".join(g.name for g in groups)]
    _run(*argv, name)
    before: set[str] = set()
    try:
        import pwd

        pw = pwd.getpwnam(name)
        before = _shm_files_of(pw.pw_uid)
        yield User(name, pw.pw_uid, pw.pw_gid)
    finally:
        subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True, timeout=60)
        _remove_shm_files_of(name, keep=before)
        subprocess.run(["userdel", "--force", name], capture_output=True, timeout=60)
        subprocess.run(["groupdel", name], capture_output=True, timeout=60)


def _shm_files_of(uid: int) -> set[str]:
    """The names in /dev/shm owned by ``uid``."""
    found: set[str] = set()
    with os.scandir("/dev/shm") as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid == uid:
                    found.add(entry.name)
    return found


def _remove_shm_files_of(name: str, keep: set[str]) -> None:
    """What the throwaway user ``name`` left in /dev/shm: a killed daemon's segments (nothing
    else can clean them up after a SIGKILL: docs/reliability.md), a killed or failed process's
    ``sem.mp-*`` (multiprocessing's resource tracker unlinks them only if it ran to the end).
    Its files only: owned by its uid while the account (and so the uid) still exists, and not
    there already when the account was made (``keep``: left by an earlier owner of the uid)."""
    import pwd

    try:
        uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        return
    for leftover in _shm_files_of(uid) - keep:
        with contextlib.suppress(OSError):
            path = Path("/dev/shm") / leftover
            if path.lstat().st_uid == uid:
                path.unlink()


@contextlib.contextmanager
def throwaway_users(count: int, groups: tuple[Group, ...] = ()) -> Iterator[list[User]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(throwaway_user(groups)) for _ in range(count)]


def supplementary_gids(user: User) -> list[int]:
    return os.getgrouplist(user.name, user.gid)


# Imported lazily by numpy, h5py or torch on first use: import them here, in the parent,
# because a child acting as another user may not be able to read the interpreter's files.
_LAZY_IMPORTS = ("numpy.ma", "numpy.lib.recfunctions", "warnings", "h5py._hl.vds")


def as_user(user: User, fn: Callable[[], object], timeout: float = 60) -> tuple[str, object]:
    """Run ``fn`` in a forked child that dropped to ``user`` for good (groups, gid, uid).
    Returns ``("ok", result)`` or ``("error", "ExcType: message")``. Everything ``fn`` needs
    must already be imported: the parent interpreter's files may not be readable as ``user``.
    The child is killed when the deadline passes."""
    return as_ids(user.uid, user.gid, supplementary_gids(user), fn, timeout)


def as_ids(uid: int, gid: int, groups: list[int], fn: Callable[[], object], timeout: float = 60) -> tuple[str, object]:
    """``as_user`` for ids that need not belong to an account (e.g. nobody's 65534)."""
    import importlib

    for name in _LAZY_IMPORTS:
        importlib.import_module(name)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(read)
            os.setgroups(groups)
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            try:
                result: object = ("ok", fn())
            except BaseException as exc:  # noqa: BLE001 - reported, the parent asserts
                result = ("error", f"{type(exc).__name__}: {exc}")
            os.write(write, pickle.dumps(result))
        finally:
            os._exit(0)
    os.close(write)
    try:
        chunks = []
        while select.select([read], [], [], timeout)[0]:
            chunk = os.read(read, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        if not chunks:
            return ("error", f"TimeoutError: the child acting as uid {uid} reported nothing within {timeout}s")
        return pickle.loads(b"".join(chunks))
    finally:
        os.close(read)
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)


def setpriv(user: User) -> list[str]:
    """The argv prefix that runs a command as ``user`` (real and effective ids, its groups)."""
    return ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--init-groups", "--"]


def run_as(user: User, argv: list[str], env: dict[str, str] | None = None,
           timeout: float = 60, cwd: str | None = "/") -> subprocess.CompletedProcess[str]:
    """Run ``argv`` as ``user`` (via setpriv) with a deadline; kills it when the deadline passes."""
    return subprocess.run(setpriv(user) + argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)


@dataclass(frozen=True)
class PortablePython:
    """An interpreter and h5serve any user can run: ``argv("status")`` is ``h5serve status``."""

    root: Path
    python: str
    env: dict[str, str]
    h5serve_bin: Path  # a shell wrapper, for scripts that take a command (H5SERVE_BIN)

    def argv(self, *args: str) -> list[str]:
        return [self.python, "-m", "h5serve", *args]

    def run(self, *args: str, user: User | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """``h5serve *args`` as ``user`` (default: as we are), from ``/`` (``python -m`` puts
        the working directory first on the path: never the repository's checkout)."""
        if user is not None:
            return run_as(user, self.argv(*args), env=self.env, timeout=timeout)
        return subprocess.run(self.argv(*args), env=self.env, capture_output=True, text=True, timeout=timeout, cwd="/")


def _same_minor(python: str) -> bool:
    want = f"{sys.version_info.major}.{sys.version_info.minor}"
    done = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                          capture_output=True, text=True, timeout=30)
    return done.returncode == 0 and done.stdout.strip() == want


@contextlib.contextmanager
def portable_python() -> Iterator[PortablePython]:
    """Copies of the daemon's packages and of h5serve, world-readable, run by /usr/bin/python3.

    Skips when there is no system Python of this minor version (compiled packages would not load).
    """
    python = "/usr/bin/python3"
    if not os.path.exists(python) or not _same_minor(python):
        pytest.skip(f"no {python} of Python {sys.version_info.major}.{sys.version_info.minor} to run as other users")
    root = Path(tempfile.mkdtemp(prefix="h5s-py-", dir="/tmp"))
    try:
        site = root / "site"
        site.mkdir()
        purelib = Path(sysconfig.get_paths()["purelib"])
        for name in _PORTABLE_PACKAGES:
            if (purelib / name).is_dir():
                shutil.copytree(purelib / name, site / name, symlinks=False)
        shutil.copytree(REPO / "h5serve", site / "h5serve", ignore=shutil.ignore_patterns("__pycache__"))
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONPATH": str(site),
               "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}
        wrapper = root / "h5serve"
        wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={site} PYTHONDONTWRITEBYTECODE=1 exec {python} -m h5serve "$@"\n')
        for path in [root, *root.rglob("*")]:
            if not path.is_symlink():
                path.chmod(0o755 if path.is_dir() or path == wrapper else 0o644)
        for so in root.rglob("*.so*"):
            so.chmod(0o755)
        yield PortablePython(root, python, env, wrapper)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@dataclass(frozen=True)
class PublicInterpreter:
    """The suite's own interpreter (torch included) at a path any user can reach."""

    root: Path  # the world-readable directory holding it (what cluster nodes must be given: ``share=``)
    python: str  # also the ``sys.executable`` of what it runs: spawned workers, resource tracker, torchrun
    env: dict[str, str]  # PYTHONPATH: this checkout; the suite's site-packages are the interpreter's own


_PROBE = "import os, sys, sysconfig; print(os.__file__, sys.executable, sysconfig.get_paths()['purelib'], sep='\\n')"


def _mounts_under(root: Path) -> list[str]:
    """Mount points at or below ``root`` (this process's mount namespace)."""
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        points = [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), line.split()[4]) for line in f]
    return [p for p in points if p == str(root) or p.startswith(f"{root}/")]


def _venv_config(home: Path) -> str:
    """A ``pyvenv.cfg`` like the suite's venv's, with the mounted base installation as ``home``."""
    include = "false"
    with contextlib.suppress(OSError):
        for line in (Path(sys.prefix) / "pyvenv.cfg").read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip().lower() == "include-system-site-packages":
                include = value.strip()
    return (f"home = {home}\ninclude-system-site-packages = {include}\n"
            f"version = {'.'.join(map(str, sys.version_info[:3]))}\n")


def _not_world_readable(paths: list[Path], root: Path) -> list[str]:
    """Those of ``paths`` (under ``root``), or of their directories up to ``root``, that other
    users cannot read (files), run (executables) or list and enter (directories)."""
    bad = []
    for path in paths:
        for p in (path, *[d for d in path.parents if d.is_relative_to(root)]):
            with contextlib.suppress(OSError):
                mode = p.stat().st_mode
                need = 0o005 if p.is_dir() or mode & 0o100 else 0o004
                if mode & need != need:
                    bad.append(f"{p} (mode {mode & 0o777:o})")
    return sorted(set(bad))


@contextlib.contextmanager
def public_interpreter() -> Iterator[PublicInterpreter]:
    """The interpreter running the suite, with its packages (torch included), where a throwaway
    user can run it, whatever launched the suite: a virtualenv, pyenv, conda, the system's.

    The real installation (``sys.base_prefix``, holding the binary a venv's ``bin/python`` only
    links to, here into a 0700 ``/root``) is bind-mounted read-only on ``<root>/base``. From a
    virtualenv, ``<root>/venv`` is that venv made again around it: a ``pyvenv.cfg`` whose ``home``
    is the mounted base, ``bin/pythonX.Y`` a link to the mounted binary, the venv's site-packages
    bind-mounted read-only at their place. A job user then runs the suite's own interpreter (same
    packages, ``.pth`` files included), and its ``sys.executable`` (what spawned DataLoader
    workers, multiprocessing's resource tracker and torchrun start) is reachable too. Checked by
    running it as uid 65534; unmounted in ``finally``. Skips with the reason (and what to do)
    where it cannot be made."""
    base = Path(sys.base_prefix).resolve()
    binary = Path(getattr(sys, "_base_executable", None) or sys.executable).resolve()
    if not binary.is_relative_to(base):
        pytest.skip(f"the interpreter's binary {binary} lies outside its installation {base}: other users "
                    "cannot be given it; run the suite with an interpreter installed under its prefix")
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    root = Path(tempfile.mkdtemp(prefix="h5s-pfx-", dir="/tmp"))
    root.chmod(0o755)

    def bind(source: Path, target: Path) -> None:
        target.mkdir(mode=0o755, parents=True)
        if subprocess.run(["mount", "--bind", "-o", "ro", str(source), str(target)], capture_output=True,
                          timeout=30).returncode != 0:
            pytest.skip(f"cannot bind-mount {source} (the interpreter running the suite) where other users can "
                        "run it: needs root and mount(8); run as root, or with an interpreter all users can read")

    try:
        bind(base, root / "base")
        python = root / "base" / binary.relative_to(base)
        site_dirs: list[Path] = []
        if sys.prefix != sys.base_prefix:  # a virtualenv: its packages, run by the real binary
            prefix = Path(sys.prefix).resolve()
            venv = root / "venv"
            (venv / "bin").mkdir(mode=0o755, parents=True)
            (venv / "pyvenv.cfg").write_text(_venv_config(python.parent))
            (venv / "pyvenv.cfg").chmod(0o644)
            for kind in ("purelib", "platlib"):
                site_dir = Path(sysconfig.get_paths()[kind]).resolve()
                if not site_dir.is_relative_to(prefix):
                    pytest.skip(f"the virtualenv's {kind} {site_dir} lies outside it ({prefix}): other users "
                                "cannot be given it; run the suite from a virtualenv holding its packages")
                if not (venv / site_dir.relative_to(prefix)).exists():
                    bind(site_dir, venv / site_dir.relative_to(prefix))
                    site_dirs.append(venv / site_dir.relative_to(prefix))
            (venv / "bin" / version).symlink_to(python)
            python = venv / "bin" / version
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
               # its libpython: the binary's rpath names the unreachable original
               "LD_LIBRARY_PATH": f"{root}/base/lib", "PYTHONPATH": str(REPO)}
        probe = subprocess.run([str(python), "-c", _PROBE], env=env, user=65534, group=65534, extra_groups=[],
                               cwd="/", capture_output=True, text=True, timeout=60)
        if probe.returncode != 0 or not all(line.startswith(f"{root}/") for line in probe.stdout.splitlines()):
            stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
            mine = [python.resolve(), *site_dirs, *([root / "base" / stdlib.relative_to(base) / "os.py"]
                                                   if stdlib.is_relative_to(base) else [])]
            unreadable = _not_world_readable(mine, root)
            said = f"exit {probe.returncode}:\n{probe.stdout}{probe.stderr}"
            if unreadable:
                pytest.skip(f"the interpreter's files are not readable by other users ({', '.join(unreadable)}): "
                            f"install it, and the virtualenv, with umask 022 ({python} as uid 65534: {said})")
            pytest.fail(f"{python}, the suite's interpreter as other users see it, does not run as uid 65534 "
                        f"from {root}: {said}")
        yield PublicInterpreter(root, str(python), env)
    finally:
        for point in sorted(_mounts_under(root), reverse=True):  # children first
            if subprocess.run(["umount", point], capture_output=True, timeout=60).returncode != 0:
                # still busy (a job's process not yet gone): detached now, freed when it exits
                subprocess.run(["umount", "--lazy", point], capture_output=True, timeout=60)
        if not _mounts_under(root):  # never a removal while mounted: it would reach the interpreter's tree
            shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def running_as(user: User | None, fn: Callable[[], object]) -> Iterator[int]:
    """Run ``fn`` (a loop that never returns) in a forked child that dropped to ``user`` for
    good (None: as we are) for the duration of the block; SIGKILLed and reaped on exit.
    Yields its pid."""
    import importlib

    for name in _LAZY_IMPORTS:
        importlib.import_module(name)
    pid = os.fork()
    if pid == 0:  # child
        try:
            if user is not None:
                os.setgroups(supplementary_gids(user))
                os.setresgid(user.gid, user.gid, user.gid)
                os.setresuid(user.uid, user.uid, user.uid)
            fn()
        finally:
            os._exit(0)
    try:
        yield pid
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange_forever(a: Path, b: Path, pause: float = 0.0) -> Callable[[], object]:
    """A loop swapping the directory entries ``a`` and ``b`` atomically (``renameat2(RENAME_EXCHANGE)``
    through libc: a symlink and a file, a FIFO and a file), as fast as it can or with a random
    pause of up to ``pause`` seconds between swaps (each side then stays long enough for a
    whole load to see it)."""
    import ctypes
    import random

    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = libc.renameat2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    first, second = os.fsencode(a), os.fsencode(b)

    def loop() -> None:
        if renameat2(_AT_FDCWD, first, _AT_FDCWD, second, _RENAME_EXCHANGE) != 0:
            raise OSError(ctypes.get_errno(), "renameat2(RENAME_EXCHANGE) failed")
        while True:
            renameat2(_AT_FDCWD, first, _AT_FDCWD, second, _RENAME_EXCHANGE)
            if pause:
                time.sleep(random.uniform(0, pause))  # the attacker's pace, not a wait in the test

    return loop
