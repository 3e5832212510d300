"""``h5serve start`` and ``h5serve stop``: the daemon's life, from the command line. ``start``
checks its arguments and the account, spawns ``python -m h5serve.daemon`` (or serves in the
foreground) and returns once the daemon answers; ``stop`` asks it to stop, or signals only the
process proven to be the daemon."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import ConfigError, DaemonAlreadyRunning, DaemonUnavailable, H5ServeError, host_error
from ..wire.protocol import Ping
from ..wire.runtime import arena_wanted, ensure_runtime_dir, resolve_runtime, resolve_shm_dir
from .common import EXIT_OK, daemon_client

__all__ = ["cmd_start", "cmd_stop", "START_TIMEOUT_S", "STOP_TIMEOUT_S"]

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0


def cmd_start(args: argparse.Namespace) -> int:
    # the daemon works from / (daemon/_process.start_from_root): paths given relative to here first
    for name in ("runtime_dir", "shm_dir", "metrics_textfile", "hold_dir"):
        if getattr(args, name):
            setattr(args, name, os.path.abspath(getattr(args, name)))
    args.allow_root = [os.path.abspath(root) for root in args.allow_root or ()]
    from ..daemon.access.urls import parse_allow_url

    args.allow_url = [parse_allow_url(prefix) for prefix in args.allow_url or ()]  # ConfigError before it starts
    from ..daemon.access.privileges import drop_privileges, lookup_group, lookup_user, prepare_runtime_dir
    from ..util.units import parse_size

    account = lookup_user(args.user) if args.user else None
    if args.group is not None:
        lookup_group(args.group)
    if args.max_memory is not None:
        parse_size(args.max_memory)  # a bad size is the caller's error, not a failed start
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise ConfigError(f"--metrics-port must be in 0..65535 (0: any free port), got {args.metrics_port}")
    if account is not None and os.geteuid() != 0 and os.getuid() != account.uid:
        raise ConfigError(f"--user {account.name} needs `h5serve start` to run as root")
    location = resolve_runtime(args.runtime_dir, uid=account.uid if account else None)
    if account is not None and os.geteuid() != account.uid:
        # Root does one thing for the user (the dir, by descriptor) and then is the user for
        # good: the log, pidfile and socket are opened as the user, in the user's dir.
        prepare_runtime_dir(location, account)
        drop_privileges(account)
        _check_interpreter(account.name)
    if args.foreground:
        return _run_foreground(args, location)
    dir_fd = ensure_runtime_dir(location)
    try:
        with daemon_client(location.directory, timeout=2.0) as client:
            if client.available():
                info = client.ping()
                print(f"h5serve daemon already running (pid {info['pid']}) on {location.directory}")
                return EXIT_OK
            process = _spawn_daemon(args, location, dir_fd)
            deadline = time.monotonic() + START_TIMEOUT_S
            while time.monotonic() < deadline:
                if client.available():
                    try:
                        info = client.request(Ping(), timeout=1.0)
                    except DaemonUnavailable:
                        continue
                    print(f"h5serve daemon started (pid {info['pid']}) on {location.endpoint}; log: {location.logfile}")
                    return EXIT_OK
                if process.poll() not in (None, 0):  # 0: another start won the race; wait for its daemon
                    break
                time.sleep(0.05)
            if process.poll() is None:
                process.kill()
            raise H5ServeError(
                f"the daemon did not start on {location.directory}; last log lines:\n  "
                + "\n  ".join(_log_tail(dir_fd))
            )
    finally:
        os.close(dir_fd)


def _check_interpreter(user: str) -> None:
    """Raised when the user we now are cannot run this interpreter (loaders start it): ConfigError."""
    if not os.access(sys.executable, os.X_OK):
        raise ConfigError(
            f"user {user!r} cannot run the Python interpreter {sys.executable}; install h5serve "
            "where that user can run it (e.g. a venv outside /root)"
        )


def _open_log(dir_fd: int, flags: int = os.O_WRONLY | os.O_CREAT | os.O_APPEND) -> int:
    """The daemon's log in the (checked) runtime dir: never through a symlink, never a FIFO,
    only a file of ours."""
    from ..util.safeio import open_regular
    from ..wire.runtime import LOGFILE_NAME

    return open_regular(LOGFILE_NAME, ConfigError, owners={os.geteuid()}, flags=flags, dir_fd=dir_fd,
                        hint="remove it from the runtime dir")[0]


def _log_tail(dir_fd: int, lines: int = 5) -> list[str]:
    try:
        fd = _open_log(dir_fd, os.O_RDONLY)
    except ConfigError as exc:
        return [str(exc)]
    with open(fd, "rb") as f:
        return f.read()[-16384:].decode(errors="replace").strip().splitlines()[-lines:]


def _spawn_daemon(args: argparse.Namespace, location: Any, dir_fd: int) -> subprocess.Popen[bytes]:
    from ..daemon._process import SAFE_DIR, SAFE_PYTHON_FLAGS, package_root, quiet_blas, safe_python_env, safe_sys_path

    cmd = [sys.executable, *SAFE_PYTHON_FLAGS, "-m", "h5serve.daemon", "--runtime-dir", str(location.directory)]
    for flag in ("shm_dir", "max_memory", "loaders", "load_processes", "log_level", "group", "user",
                 "metrics_port", "metrics_addr", "metrics_textfile", "stall_timeout", "idle_exit", "hold_dir"):
        value = getattr(args, flag)
        if value is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(value)]
    if args.no_checksum:
        cmd.append("--no-checksum")
    if args.keep_page_cache:
        cmd.append("--keep-page-cache")
    if args.metrics_paths:
        cmd.append("--metrics-paths")
    for root in args.allow_root or ():
        cmd += ["--allow-root", root]
    for prefix in args.allow_url or ():
        cmd += ["--allow-url", prefix]
    env = dict(os.environ)
    quiet_blas(env)
    safe_python_env(env)
    # $PYTHONPATH is the starter's configuration: kept, made absolute (the daemon works from /);
    # h5serve itself stays importable when it was found through the working directory (a checkout)
    paths = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if package_root() not in safe_sys_path(sys.path) and package_root() not in paths:
        paths.append(package_root())
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    log = _open_log(dir_fd)
    try:
        return subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True, env=env,
            cwd=SAFE_DIR,
        )
    except OSError as exc:
        raise host_error(exc, f"running {sys.executable} to start the daemon") from exc
    finally:
        os.close(log)


def _run_foreground(args: argparse.Namespace, location: Any) -> int:
    from ..daemon import DaemonConfig, serve
    from ..daemon._process import set_undumpable, start_from_root
    from ..daemon.access.privileges import drop_privileges, lookup_group, lookup_user
    from ..daemon.config import DEFAULT_STALL_TIMEOUT_S
    from ..util.units import parse_size

    logging.basicConfig(
        level=getattr(logging, (args.log_level or "INFO").upper(), logging.INFO),
        format="%(asctime)s h5serve[%(process)d] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    if args.user:
        drop_privileges(lookup_user(args.user))  # a no-op when cmd_start already did
        _check_interpreter(args.user)
    set_undumpable()  # as its final user, before it reads its secret or opens anything: no ptrace by that user
    config = DaemonConfig(
        location=location,
        shm_dir=resolve_shm_dir(args.shm_dir),
        max_memory=parse_size(args.max_memory) if args.max_memory is not None else None,
        loaders=args.loaders or 0,
        load_processes=args.load_processes or 0,
        group=lookup_group(args.group) if args.group is not None else None,
        allow_roots=tuple(Path(r) for r in args.allow_root),  # made absolute by cmd_start
        allow_urls=tuple(args.allow_url or ()),
        metrics_port=args.metrics_port,
        metrics_addr=args.metrics_addr or "127.0.0.1",
        metrics_textfile=Path(os.path.abspath(args.metrics_textfile)) if args.metrics_textfile else None,
        stall_timeout=args.stall_timeout if args.stall_timeout is not None else DEFAULT_STALL_TIMEOUT_S,
        checksum=not args.no_checksum,
        drop_page_cache=not args.keep_page_cache,
        metrics_paths=args.metrics_paths,
        idle_exit=args.idle_exit or 0.0,
        hold_dir=Path(args.hold_dir) if args.hold_dir else None,
        arenas=arena_wanted(),
    )
    start_from_root()  # the daemon, its forkserver and loaders: from /, no implicit sys.path entry
    try:
        serve(config)
    except DaemonAlreadyRunning as exc:
        print(f"{exc}; nothing to do", file=sys.stderr)
    return EXIT_OK


def cmd_stop(args: argparse.Namespace) -> int:
    from ..wire.runtime import read_pid, signal_daemon

    with daemon_client(args.runtime_dir) as client:
        if not client.available():
            print(f"no h5serve daemon running on {client.location.directory}")
            return EXIT_OK
        owner = client.daemon_uid if client.daemon_uid is not None else os.geteuid()
        pid = read_pid(client.location, owner)
        try:
            pid = client.shutdown().get("pid", pid)
        except DaemonUnavailable:
            # Not answering: signal it, but only the process proven to be this dir's daemon
            # (owner's, holding the pidfile lock), never whatever pid the file names.
            pid = signal_daemon(client.location, owner, signal.SIGTERM) or pid
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while client.available() and time.monotonic() < deadline:
            time.sleep(0.05)
        if client.available():
            raise H5ServeError(f"the daemon (pid {pid}) did not stop within {STOP_TIMEOUT_S:g}s; "
                               f"kill it with `kill {pid}`")
    print(f"h5serve daemon stopped (pid {pid})")
    return EXIT_OK


