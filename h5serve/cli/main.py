"""``h5serve`` command line: the command table (``build_parser``: every command, its arguments
and the function that runs it), and ``main``, which maps errors to exits. Each command is in a
module of its own: start.py (start, stop), status.py, preload.py, plan.py, inspect.py; demo and
inspect are run from here.

Exit codes: 0 success; 1 an h5serve error (the message says what to do); 2 bad usage;
3 ``status``: no daemon is running.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator, Sequence

from .. import __version__
from ..errors import ConfigError, H5ServeError, host_error
from ..util.logtext import printable_lines
from .common import EXIT_ERROR, EXIT_NOT_RUNNING, EXIT_OK, EXIT_USAGE
from .plan import add_plan_arguments, run_plan
from .preload import cmd_preload
from .start import cmd_start, cmd_stop
from .status import cmd_status

DEMO_ROWS = 100_000  # h5serve.demo.DEFAULT_ROWS (not imported: the demo pulls in h5py for every command)

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_ERROR", "EXIT_USAGE", "EXIT_NOT_RUNNING"]


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


def _idle_seconds(text: str) -> float:
    """An argparse type: a number of seconds >= 0, 0 meaning never (anything else is bad usage: exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a number of seconds (0: never), got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0 (0: never), got {text!r}")
    return value


def cmd_demo(args: argparse.Namespace) -> int:
    from ..demo import run_demo

    if args.rows < args.nproc:
        raise ConfigError(f"--rows must be at least {args.nproc} (one row per rank), got {args.rows}")
    if args.steps < 0:
        raise ConfigError(f"--steps must be at least 0, got {args.steps}")
    return run_demo(rows=args.rows, nproc=args.nproc, seconds=args.seconds, steps=args.steps)


def cmd_inspect(args: argparse.Namespace) -> int:
    from ..util.units import parse_size
    from .inspect import format_report, inspect_file

    report = inspect_file(
        args.file, keys=args.key, world_size=args.world_size, ranks_per_node=args.ranks_per_node, mode=args.mode,
        max_memory=parse_size(args.max_memory) if args.max_memory is not None else None,
        shm_dir=args.shm_dir, runtime_dir=args.runtime_dir,
    )
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
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
    p.add_argument("--allow-url", action="append", metavar="PREFIX",
                   help="fetch s3:// objects under PREFIX (s3://bucket/prefix/) with the daemon's own credentials; "
                   "repeatable. A shared daemon (--group, or root) fetches no URL without it; a daemon run by a "
                   "user for themself fetches any URL its credentials can read unless it is given")
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
    p.add_argument("--idle-exit", type=_idle_seconds, metavar="SECONDS",
                   help="exit (segments unlinked, as `h5serve stop` does) after SECONDS with no request but "
                   "`status`, no segment mapped by any process and no load running or queued; checked every "
                   "second (default 0: never)")
    p.add_argument("--hold-dir", metavar="DIR",
                   help="with --idle-exit: never idle while DIR has an entry (a SLURM prolog's hold for each "
                   "running job of the daemon's user; a directory the user cannot write)")
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
    p.add_argument("file", help="the HDF5 file, or its URL (s3://bucket/key.h5, https://...: pip install "
                   "'h5serve[s3]')")
    p.add_argument("--key", action="append", metavar="K",
                   help="only this dataset (repeatable; default: every dataset in the file)")
    p.add_argument("--world-size", type=_at_least_one, default=1, metavar="W", help="ranks in the job (default 1)")
    p.add_argument("--ranks-per-node", type=_at_least_one, metavar="R",
                   help="of them on this node (default: all W)")
    p.add_argument("--mode", choices=["contiguous", "interleave", "node", "global", "stream"],
                   help="the mode the job will use (default: show every mode; advice for global; stream: the "
                        "window and block a daemon of this budget picks)")
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
        # a message may quote a path or key as it came (another user's file name): escaped, its lines indented
        print(f"h5serve: error: {printable_lines(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:
        # `h5serve status | head -1`: quiet, and no second error when Python flushes stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130

