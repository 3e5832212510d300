"""``h5serve`` command line: parses arguments, calls library functions, maps errors to exits.

Exit codes: 0 success; 1 an h5serve error (the message says what to do); 2 bad usage;
3 ``status``: no daemon is running.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from . import __version__
from ._status_cli import format_status, format_verify, verify_segments
from .errors import ConfigError, DaemonAlreadyRunning, DaemonUnavailable, H5ServeError, host_error
from .util.units import format_bytes
from .wire.protocol import Ping
from .wire.runtime import ensure_runtime_dir, resolve_runtime, resolve_shm_dir

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NOT_RUNNING = 0, 1, 2, 3
START_TIMEOUT_S = 30.0
DEMO_ROWS = 100_000  # h5serve.demo.DEFAULT_ROWS (not imported: the demo pulls in h5py for every command)
STOP_TIMEOUT_S = 30.0

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_ERROR", "EXIT_USAGE", "EXIT_NOT_RUNNING"]


def parse_ranks(text: str, world_size: int) -> list[int]:
    """'0-3,5' -> [0, 1, 2, 3, 5]. Raised when malformed or out of range: ConfigError."""
    ranks: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            ranks.update(range(int(lo), int(hi or lo) + 1))
    except ValueError as exc:
        raise ConfigError(f"--ranks {text!r} is not a list like 0-3,5") from exc
    bad = sorted(r for r in ranks if not 0 <= r < world_size)
    if bad or not ranks:
        raise ConfigError(f"--ranks {text!r}: ranks must be in [0, {world_size - 1}] (got {bad or 'none'})")
    return sorted(ranks)


def _at_least_one(text: str) -> int:
    """An argparse type: an integer >= 1 (anything else is bad usage: exit 2, argparse names the option)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    """An argparse type: a number of seconds > 0 (anything else is bad usage: exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _client(runtime_dir: str | os.PathLike[str] | None, timeout: float | None = None) -> Any:
    from .wire.connection import DaemonClient  # zmq only for the commands that talk

    return DaemonClient(runtime_dir, timeout)


def cmd_start(args: argparse.Namespace) -> int:
    # the daemon works from / (daemon/_process.start_from_root): paths given relative to here first
    for name in ("runtime_dir", "shm_dir", "metrics_textfile"):
        if getattr(args, name):
            setattr(args, name, os.path.abspath(getattr(args, name)))
    args.allow_root = [os.path.abspath(root) for root in args.allow_root or ()]
    from .daemon.privileges import drop_privileges, lookup_group, lookup_user, prepare_runtime_dir
    from .util.units import parse_size

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
        with _client(location.directory, timeout=2.0) as client:
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
    from .util.safeio import open_regular
    from .wire.runtime import LOGFILE_NAME

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
    from .daemon._process import SAFE_DIR, SAFE_PYTHON_FLAGS, package_root, quiet_blas, safe_python_env, safe_sys_path

    cmd = [sys.executable, *SAFE_PYTHON_FLAGS, "-m", "h5serve.daemon", "--runtime-dir", str(location.directory)]
    for flag in ("shm_dir", "max_memory", "loaders", "load_processes", "log_level", "group", "user",
                 "metrics_port", "metrics_addr", "metrics_textfile", "stall_timeout"):
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
    from .daemon import DaemonConfig, serve
    from .daemon._process import start_from_root
    from .daemon.config import DEFAULT_STALL_TIMEOUT_S
    from .daemon.privileges import drop_privileges, lookup_group, lookup_user
    from .util.units import parse_size

    logging.basicConfig(
        level=getattr(logging, (args.log_level or "INFO").upper(), logging.INFO),
        format="%(asctime)s h5serve[%(process)d] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    if args.user:
        drop_privileges(lookup_user(args.user))  # a no-op when cmd_start already did
        _check_interpreter(args.user)
    config = DaemonConfig(
        location=location,
        shm_dir=resolve_shm_dir(args.shm_dir),
        max_memory=parse_size(args.max_memory) if args.max_memory is not None else None,
        loaders=args.loaders or 0,
        load_processes=args.load_processes or 0,
        group=lookup_group(args.group) if args.group is not None else None,
        allow_roots=tuple(Path(r) for r in args.allow_root),  # made absolute by cmd_start
        metrics_port=args.metrics_port,
        metrics_addr=args.metrics_addr or "127.0.0.1",
        metrics_textfile=Path(os.path.abspath(args.metrics_textfile)) if args.metrics_textfile else None,
        stall_timeout=args.stall_timeout if args.stall_timeout is not None else DEFAULT_STALL_TIMEOUT_S,
        checksum=not args.no_checksum,
        drop_page_cache=not args.keep_page_cache,
        metrics_paths=args.metrics_paths,
    )
    start_from_root()  # the daemon, its forkserver and loaders: from /, no implicit sys.path entry
    try:
        serve(config)
    except DaemonAlreadyRunning as exc:
        print(f"{exc}; nothing to do", file=sys.stderr)
    return EXIT_OK


def cmd_stop(args: argparse.Namespace) -> int:
    from .wire.runtime import read_pid, signal_daemon

    with _client(args.runtime_dir) as client:
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


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args.runtime_dir) as client:
        try:
            info = client.status()
        except DaemonUnavailable as exc:
            stopped = {"running": False, "runtime_dir": str(client.location.directory)}
            print(json.dumps(stopped) if args.json else str(exc))
            return EXIT_NOT_RUNNING
    report = verify_segments(info, client.location.directory, client.daemon_uid) if args.verify else None
    if args.json:
        print(json.dumps({"running": True, **info, **({"verify": report} if report is not None else {})}, indent=2))
    else:
        print(format_status(info))
        if report is not None:
            print(format_verify(report, info["shm_dir"]))
    return EXIT_ERROR if report is not None and report["damaged"] else EXIT_OK


def cmd_preload(args: argparse.Namespace) -> int:
    from .hdf5.source import resolve_dtype
    from .util.progress import Progress
    from .wire.protocol import POLL_INTERVAL_S, Acquire, AcquireResult

    if args.mode == "global":
        if args.ranks or args.plan:
            raise ConfigError("--mode global loads the whole file once for every rank: drop --ranks/--plan")
        args.world_size, ranks = args.world_size or 1, [0]
        if args.world_size < 1:
            raise ConfigError(f"--world-size must be >= 1, got {args.world_size}")
    elif args.plan:
        if args.ranks:
            raise ConfigError("--plan and --ranks both choose ranks: pass one of them")
        from ._plan_cli import plan_from_args

        plan = plan_from_args(args)
        args.world_size, ranks = plan.world_size, list(plan.ranks)
    elif args.world_size is None:
        raise ConfigError("preload needs --world-size (or --plan inside a SLURM allocation; or --mode global)")
    if args.world_size < 1:
        raise ConfigError(f"--world-size must be >= 1, got {args.world_size}")
    if not args.plan and args.mode != "global":
        ranks = parse_ranks(args.ranks, args.world_size) if args.ranks else list(range(args.world_size))
    path = os.path.abspath(args.file)
    dtypes = {args.x_key: resolve_dtype(args.dtype_x, "--dtype-x")}
    if args.y_key:
        dtypes[args.y_key] = resolve_dtype(args.dtype_y, "--dtype-y")
    if args.mode == "node":  # the node's ranks share one block: the union of their contiguous shards
        from .order.sharding import node_selection

        block = node_selection(args.world_size, sorted(ranks))
        places = [(block.rank, block.span)]
    else:
        places = [(rank, 1) for rank in ranks]
    requests = [
        Acquire(path, key, args.world_size, rank, args.mode, None if dtype is None else dtype.str, span)
        for rank, span in places for key, dtype in dtypes.items()
    ]
    start = time.monotonic()
    with _client(args.runtime_dir) as client:
        results = [AcquireResult.from_wire(client.request(r)) for r in requests]  # starts every load
        bar = Progress(f"preloading {len(requests)} segments", sum(r.rows_total for r in results),
                       lambda line: print(line, file=sys.stderr, flush=True))
        try:
            while not all(r.state == "ready" for r in results):
                time.sleep(POLL_INTERVAL_S)
                results = [r if r.state == "ready" else AcquireResult.from_wire(client.request(q))
                           for q, r in zip(requests, results)]
                bar.update(sum(r.rows_done for r in results))
        finally:
            bar.close()
        status = client.status()
    loaded = [s for s in status["segments"] if s["file"] == os.path.realpath(path) and s["state"] == "ready"]
    print(f"preloaded {len(requests)} segments of {path} for ranks {ranks} in {time.monotonic() - start:.2f}s "
          f"({format_bytes(sum(s['bytes'] for s in loaded))} for this file in shm)")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    if args.rows < args.nproc:
        raise ConfigError(f"--rows must be at least {args.nproc} (one row per rank), got {args.rows}")
    if args.steps < 0:
        raise ConfigError(f"--steps must be at least 0, got {args.steps}")
    return run_demo(rows=args.rows, nproc=args.nproc, seconds=args.seconds, steps=args.steps)


def cmd_inspect(args: argparse.Namespace) -> int:
    from .inspect import format_report, inspect_file
    from .util.units import parse_size

    report = inspect_file(
        args.file, keys=args.key, world_size=args.world_size, ranks_per_node=args.ranks_per_node, mode=args.mode,
        max_memory=parse_size(args.max_memory) if args.max_memory is not None else None,
        shm_dir=args.shm_dir, runtime_dir=args.runtime_dir,
    )
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    from ._plan_cli import add_plan_arguments, run_plan

    parser = argparse.ArgumentParser(
        prog="h5serve",
        description="HDF5 shards in shared memory for DDP training.",
        epilog="exit codes: 0 success, 1 an h5serve error (the message says what to do), 2 bad usage, "
        "3 status: no daemon running",
    )
    parser.add_argument("--version", action="version", version=f"h5serve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_runtime(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--runtime-dir", help="where the socket and pidfile live "
                       "(default: $H5SERVE_RUNTIME_DIR, else $XDG_RUNTIME_DIR/h5serve, else /tmp/h5serve-$UID)")
        return p

    p = with_runtime(sub.add_parser("start", help="start the daemon (returns once it answers)"))
    p.add_argument("--foreground", action="store_true", help="stay attached and log to stderr (systemd, srun)")
    p.add_argument("--shm-dir", help="where segments live (default: $H5SERVE_SHM_DIR, else /dev/shm)")
    p.add_argument("--max-memory", help="memory budget for segments, e.g. 64G (default: 80%% of free shm space)")
    p.add_argument("--loaders", type=_at_least_one, metavar="N",
                   help="how many loads (one rank's shard of one dataset each) run at once "
                   "(default: cores, at most 4)")
    p.add_argument("--load-processes", type=_at_least_one, metavar="N",
                   help="how many processes one load is split across, for compressed data (h5py decompresses in "
                   "one thread per process); shards under 64 MiB stay in one process; up to --loaders x N "
                   "processes run at once (default: cores, at most 8)")
    p.add_argument("--log-level", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="default INFO (any case)")
    p.add_argument("--group", help="let this group's members connect and map segments (default: owner only)")
    p.add_argument("--allow-root", action="append", metavar="PATH",
                   help="serve only files under PATH (after resolving symlinks); repeatable")
    p.add_argument("--user", help="run as this user (start as root, e.g. from a SLURM prolog)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (0: any free port)")
    p.add_argument("--metrics-addr", help="address for --metrics-port (default 127.0.0.1; 0.0.0.0 for remote scrapes)")
    p.add_argument("--metrics-textfile", metavar="DIR",
                   help="write h5serve.prom there for node_exporter's textfile collector")
    p.add_argument("--metrics-paths", action="store_true",
                   help="label segment metrics with their file paths and dataset keys; whoever can reach "
                   "--metrics-port or read the textfile then sees every user's paths and keys (default: an "
                   "opaque segment id)")
    p.add_argument("--stall-timeout", type=_positive_seconds, metavar="SECONDS",
                   help="kill a load that makes no progress for this long (a stopped loader, a hung file system) "
                   "and fail it, so jobs read lazily and later loads run (default 120)")
    p.add_argument("--no-checksum", action="store_true",
                   help="do not store a checksum (crc32c, else crc32) of each segment's rows (hashed during the copy; "
                   "`status --verify` then cannot check content)")
    p.add_argument("--keep-page-cache", action="store_true",
                   help="leave the source files' pages a load read in the page cache (default: drop them once the "
                   "segment is ready, so the node holds the data once)")
    p.set_defaults(func=cmd_start)

    p = with_runtime(sub.add_parser("stop", help="stop the daemon and unlink its segments"))
    p.set_defaults(func=cmd_stop)

    p = with_runtime(sub.add_parser("status", help="segments and memory (exit 3 when not running)"))
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--verify", action="store_true",
                   help="re-read every loaded segment and compare its rows with the checksum taken when it was "
                   "loaded (exit 1 naming any that changed)")
    p.set_defaults(func=cmd_status)

    p = with_runtime(sub.add_parser("preload", help="load shards now; returns when they are loaded"))
    p.add_argument("file", help="the HDF5 file")
    p.add_argument("--x-key", required=True, help="dataset of inputs, e.g. images or group/images")
    p.add_argument("--y-key", help="dataset of targets (optional)")
    p.add_argument("--world-size", type=int, help="ranks in the job (with --plan: default from SLURM)")
    p.add_argument("--ranks", help="e.g. 0-3,5 (default: every rank)")
    p.add_argument("--plan", action="store_true",
                   help="load exactly the ranks that run on this node (see `h5serve plan`)")
    p.add_argument("--mode", choices=["contiguous", "interleave", "node", "global"], default="contiguous",
                   help="the sharding the training job uses (default contiguous; node: one block of the rows of "
                        "this node's ranks, from --plan or --ranks (default every rank); global: the whole file, "
                        "once per node, for every rank of any world size)")
    p.add_argument("--dtype-x", help="the dtype_x the training job asks for, e.g. float32")
    p.add_argument("--dtype-y", help="the dtype_y the training job asks for")
    add_plan_arguments(p, include_world_size=False, include_json=False)
    p.set_defaults(func=cmd_preload)

    p = sub.add_parser("plan", help="which global ranks run on this node (from SLURM variables or arguments)")
    add_plan_arguments(p)
    p.set_defaults(func=run_plan)

    p = with_runtime(sub.add_parser("inspect", help="preflight: what FILE holds, the memory each mode needs per "
                                    "node, this node's /dev/shm and limits, advice"))
    p.add_argument("file", help="the HDF5 file")
    p.add_argument("--key", action="append", metavar="K",
                   help="only this dataset (repeatable; default: every dataset in the file)")
    p.add_argument("--world-size", type=_at_least_one, default=1, metavar="W", help="ranks in the job (default 1)")
    p.add_argument("--ranks-per-node", type=_at_least_one, metavar="R",
                   help="of them on this node (default: all W)")
    p.add_argument("--mode", choices=["contiguous", "interleave", "node", "global"],
                   help="the mode the job will use (default: show every mode; advice for global)")
    p.add_argument("--max-memory", metavar="SIZE",
                   help="check against this budget (default: the running daemon's, else 80%% of the free shm space)")
    p.add_argument("--shm-dir", help="the daemon's shm dir (default: $H5SERVE_SHM_DIR, else /dev/shm)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("demo", help="why h5serve: a real 2-rank torchrun job from the daemon, again, and the "
                       "predecessor's way, measured side by side (about a minute)")
    p.add_argument("--rows", type=int, default=DEMO_ROWS,
                   help=f"rows of 3x32x32 uint8 images in the sample file (default {DEMO_ROWS}: 294 MiB)")
    p.add_argument("--nproc", type=_at_least_one, default=2, help="ranks per job (default 2)")
    p.add_argument("--seconds", type=_positive_seconds, default=2.0,
                   help="how long each rank draws batches to measure the data rate (default 2)")
    p.add_argument("--steps", type=int, default=20, help="DDP training steps of the jobs with the daemon (default 20)")
    p.set_defaults(func=cmd_demo)
    return parser


def _os_errors() -> tuple[type[BaseException], ...]:
    """The third-party errors an environment problem arrives as: OSError, and ZMQError once a
    command has imported zmq (only then can it be raised; commands that do not talk never import it)."""
    zmq = sys.modules.get("zmq")
    return (OSError,) if zmq is None else (OSError, zmq.ZMQError)


@contextlib.contextmanager
def _environment_errors(command: str) -> Iterator[None]:
    """Whatever OSError or ZMQError a command did not map where it happened leaves as the
    HostError that names it and says what to do (errors.host_error), never as a traceback."""
    try:
        yield
    except BrokenPipeError:
        raise  # the reader of our output went away: nothing to tell it
    except _os_errors() as exc:
        raise host_error(exc, f"h5serve {command}") from exc


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with _environment_errors(args.command):
            return int(args.func(args))
    except H5ServeError as exc:
        print(f"h5serve: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:
        # `h5serve status | head -1`: quiet, and no second error when Python flushes stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
