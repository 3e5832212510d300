"""``h5serve inspect FILE``: a preflight report before anyone trains.

What the file holds (rows, dtypes, chunking, filters and whether their plugins are here), the
shared memory each mode needs on a node, this node's ``/dev/shm`` (size, free space, Docker's
64 MiB default, a SLURM per-job tmpfs), whether a running daemon's shm is visible from here,
open-file limits, and advice where the layout will hurt. Pure functions returning an
``InspectReport`` (cli/inspect_report.py; ``format_report`` of cli/inspect_text.py renders it,
``InspectReport.to_dict`` is the JSON); the CLI only prints.
"""

from __future__ import annotations

import math
import os
import resource
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import h5py

from ..daemon.config import DEFAULT_MEMORY_FRACTION, default_load_processes
from ..errors import ConfigError, DaemonUnavailable, KeyNotFound, SourceNotFound, UnsupportedDataset
from ..hdf5.compound import split_field
from ..hdf5.filters import HAVE_HDF5PLUGIN, HDF5PLUGIN_FILTERS, KNOWN_FILTERS
from ..hdf5.identity import open_h5, open_remote_h5
from ..hdf5.links import dataset_names
from ..hdf5.remote import is_url, shown_url
from ..hdf5.source import inspect_dataset
from ..order.sharding import ALL_MODES, GLOBAL, NODE, STREAM, Selection
from ..order.stream_order import block_unit
from ..order.stream_plan import KeyShape, StreamWindow, recommend
from ..segments import HEADER_SIZE
from ..util.units import format_bytes, row_nbytes
from ..wire.runtime import resolve_runtime, resolve_shm_dir
from .inspect_report import (
    SCHEMA_VERSION,
    Advice,
    DaemonReport,
    DatasetReport,
    FilterReport,
    InspectReport,
    ModeNeed,
    ShmReport,
    held_keys,
)
from .inspect_text import format_report

__all__ = ["InspectReport", "DatasetReport", "FilterReport", "ModeNeed", "ShmReport", "DaemonReport", "Advice",
           "inspect_file", "shm_notes", "format_report", "SCHEMA_VERSION"]

DOCKER_SHM_BYTES = 64 * 1024**2  # Docker's default --shm-size
MAX_LISTED = 1000  # datasets listed from one file
ONE_ROW_CHUNK_MIN_ROWS = 2  # one-row chunks hurt once there is more than one row ...
ONE_ROW_CHUNK_MAX_BYTES = 256 * 1024  # ... of rows this small (a chunk lookup per MiB-sized row costs little)
TARGET_CHUNK_BYTES = 1024**2  # what the one-row-chunk advice suggests per chunk
LOW_NOFILE = 4096  # a daemon's hard open-file limit below this holds few clients at once
# HDF5's built-in filters by id; third-party ones are named by filters.KNOWN_FILTERS.
BUILTIN_FILTERS = {1: "gzip", 2: "shuffle", 3: "fletcher32", 4: "szip", 5: "nbit", 6: "scaleoffset", 32000: "lzf"}
NOT_COMPRESSION = frozenset({2, 3})  # shuffle and checksums cost little to undo


# ----- the file ---------------------------------------------------------------------------
def _filters(obj: h5py.Dataset) -> tuple[FilterReport, ...]:
    plist = obj.id.get_create_plist()
    found = []
    for i in range(plist.get_nfilters()):
        filter_id, _flags, _values, raw = plist.get_filter(i)
        name = BUILTIN_FILTERS.get(filter_id) or KNOWN_FILTERS.get(filter_id) or raw.decode(errors="replace") or "?"
        found.append(FilterReport(int(filter_id), name, bool(h5py.h5z.filter_avail(filter_id)),
                                  filter_id not in NOT_COMPRESSION))
    return tuple(found)


def _dataset_report(f: h5py.File, key: str) -> DatasetReport:
    """Raised when ``key`` is not a dataset of ``f``: KeyNotFound."""
    problem, info = "", None
    try:
        info = inspect_dataset(f, key, vlen=True)
    except (UnsupportedDataset, SourceNotFound) as exc:  # a virtual dataset's source file may be missing
        problem = str(exc)
    dataset_key, field = split_field(f, key)
    obj = f[dataset_key]  # inspect_dataset found it (or raised KeyNotFound)
    shape = tuple(int(n) for n in obj.shape or ())
    dtype = obj.dtype.fields[field][0] if field else obj.dtype
    rows = shape[0] if shape else 0
    row_shape = (*shape[1:], *dtype.shape)
    row_bytes = row_nbytes(row_shape, dtype.base)
    if info is not None and info.vlen:  # an int64 offset and the values (the mean of the first rows): an estimate
        row_bytes, dtype = 8 + math.ceil(info.mean_length * info.dtype.itemsize), info.dtype
    chunks = obj.chunks
    layout = "virtual" if obj.is_virtual else "chunked" if chunks else (
        "compact" if obj.id.get_create_plist().get_layout() == h5py.h5d.COMPACT else "contiguous")
    return DatasetReport(
        key=key, rows=rows, row_shape=row_shape, dtype=str(dtype.base), nbytes=rows * row_bytes, layout=layout,
        chunk_rows=int(chunks[0]) if chunks else None,
        chunk_bytes=obj.dtype.itemsize * _prod(chunks) if chunks else None,
        filters=_filters(obj), problem=problem, vlen=bool(info is not None and info.vlen),
    )


def _prod(values: tuple[int, ...]) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


# ----- memory per mode --------------------------------------------------------------------
def mode_rows(mode: str, total: int, world_size: int, ranks_per_node: int) -> tuple[int, int]:
    """(rows, segments) node 0 holds of a dataset of ``total`` rows in ``mode``: ranks
    ``0 .. ranks_per_node - 1`` of ``world_size`` (block placement, as torchrun and SLURM's
    default give; node 0 has the largest contiguous shards)."""
    ranks = range(min(ranks_per_node, world_size))
    if mode == GLOBAL:
        return total, 1
    if mode == NODE:
        return Selection(NODE, world_size, 0, len(ranks)).count(total), 1
    return sum(Selection(mode, world_size, r).count(total) for r in ranks), len(ranks)


def mode_needs(datasets: tuple[DatasetReport, ...], modes: tuple[str, ...], world_size: int,
               ranks_per_node: int, budget: int) -> tuple[ModeNeed, ...]:
    needs = []
    for mode in modes:
        rows = nbytes = 0
        for d in datasets:
            if not d.counted:
                continue
            n, segments = mode_rows(mode, d.rows, world_size, ranks_per_node)
            rows = max(rows, n)  # x and y of one sample are one row each: a row is counted once
            nbytes += n * d.row_bytes + segments * HEADER_SIZE
        needs.append(ModeNeed(mode, rows, nbytes, nbytes <= budget))
    return tuple(needs)


def stream_need(window: StreamWindow | None, keys: list[KeyShape]) -> ModeNeed:
    """Stream mode's shared memory on this node: its window and the keys held whole beside it
    (``window``: what a daemon of the budget picks), or, when not even one block fits (None),
    the least it would take: one block of whole chunks of every key, a header page per key."""
    if window is not None:
        rows = min(window.capacity * window.block_rows, max((k.rows for k in keys), default=0))
        return ModeNeed(STREAM, rows, window.capacity * window.block_cost + window.whole_bytes, True)
    unit = block_unit([k.chunk_rows for k in keys]) if keys else 0
    return ModeNeed(STREAM, unit, unit * sum(k.row_bytes for k in keys) + len(keys) * HEADER_SIZE, False)


# ----- the node ---------------------------------------------------------------------------
def _mount_of(path: Path, mountinfo: str) -> tuple[str, str, str] | None:
    """(mount point, root within its filesystem, filesystem type) of the mount holding ``path``,
    from /proc/self/mountinfo's text (the last of stacked mounts wins)."""
    best: tuple[str, str, str] | None = None
    target = str(path)
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or not tail:
            continue
        point = fields[4].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, fields[3].replace("\\040", " "), tail[0])
    return best


def shm_notes(size: int, mount: tuple[str, str, str] | None, env: Mapping[str, str]) -> tuple[str, ...]:
    """Which known cases this shm filesystem looks like: Docker's default 64 MiB ``/dev/shm``
    ("docker-64m"); inside a SLURM job, a ``/dev/shm`` bind-mounted from a directory of another
    filesystem, as ``job_container/tmpfs`` makes one per job ("slurm-job-tmpfs")."""
    notes = []
    if size == DOCKER_SHM_BYTES:
        notes.append("docker-64m")
    if env.get("SLURM_JOB_ID") and mount is not None and mount[1] not in ("/", ""):
        notes.append("slurm-job-tmpfs")
    return tuple(notes)


def _shm_report(shm_dir: Path) -> ShmReport:
    """Raised when the shm dir cannot be examined: ConfigError."""
    try:
        st = os.statvfs(shm_dir)
    except OSError as exc:
        raise ConfigError(f"shm dir {shm_dir} cannot be examined ({exc.strerror}); pass --shm-dir or mount a tmpfs "
                          "there") from exc
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text()
    except OSError:
        mountinfo = ""
    size = st.f_blocks * st.f_frsize
    mount = _mount_of(Path(os.path.realpath(shm_dir)), mountinfo)
    return ShmReport(str(shm_dir), size, st.f_bavail * st.f_frsize, shm_notes(size, mount, os.environ))


def _same_file(a: str, b: str) -> bool | None:
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return None
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _daemon_report(runtime_dir: str | os.PathLike[str] | None) -> DaemonReport:
    from ..wire.connection import DaemonClient

    location = resolve_runtime(runtime_dir)
    try:
        with DaemonClient(location.directory, timeout=2.0) as client:
            if not client.available():
                return DaemonReport(str(location.directory), False, how="no daemon runs there")
            info = client.status()
    except DaemonUnavailable as exc:
        return DaemonReport(str(location.directory), False, how=str(exc))
    shm_dir = info["shm_dir"]
    visible, how = None, ""
    ready = [s["name"] for s in info["segments"] if s.get("state") == "ready" and s.get("name")]
    if ready:
        visible = os.path.exists(os.path.join(shm_dir, ready[0]))
        how = f"its segment {ready[0]} is {'' if visible else 'not '}visible in {shm_dir} from here"
    else:
        same = _same_file(f"/proc/{info['pid']}/root{shm_dir}", shm_dir)
        if same is not None:
            visible = same
            how = (f"its {shm_dir} is {'' if same else 'not '}the filesystem at {shm_dir} here "
                   f"(/proc/{info['pid']}/root)")
        else:
            how = (f"cannot tell from here (no segment loaded yet, its process is not visible); compare "
                   f"`stat -c '%d:%i' {shm_dir}` in both places")
    memory = info.get("memory", {})
    return DaemonReport(str(location.directory), True, int(info["pid"]), shm_dir, memory.get("budget"),
                        memory.get("used"), visible, how)


# ----- advice -----------------------------------------------------------------------------
def _advice(report_parts: dict[str, Any]) -> tuple[Advice, ...]:
    datasets: tuple[DatasetReport, ...] = report_parts["datasets"]
    out: list[Advice] = []
    cores = default_load_processes()
    for d in datasets:
        missing = [f for f in d.filters if not f.available]
        for f in missing:
            fix = ("install the filters extra: pip install 'h5serve[filters]' (hdf5plugin)"
                   if f.id in HDF5PLUGIN_FILTERS and not HAVE_HDF5PLUGIN
                   else "install an HDF5 plugin for it (HDF5_PLUGIN_PATH) or rewrite the dataset with gzip or lzf")
            out.append(Advice("missing_filter", d.key, f"{d.key!r} needs HDF5 filter {f.name!r} (id {f.id}), which "
                                                       f"is not available here: {fix}"))
        if d.problem and not missing:
            out.append(Advice("unservable", d.key, d.problem))
        if d.chunk_rows == 1 and d.rows >= ONE_ROW_CHUNK_MIN_ROWS and d.row_bytes < ONE_ROW_CHUNK_MAX_BYTES:
            rows = min(d.rows, max(1, TARGET_CHUNK_BYTES // max(d.row_bytes, 1)))
            shape = "x".join(str(n) for n in (rows, *d.row_shape))
            out.append(Advice("one_row_chunks", d.key, (
                f"{d.key!r} stores one row per chunk ({d.rows:,} chunks): lazy reads (no daemon, or a fallback) look "
                f"up a chunk per row and are slow; rewrite it with ~1 MiB chunks, e.g. "
                f"h5repack -l /{d.key.split(':')[0]}:CHUNK={shape} IN.h5 OUT.h5")))
        compressors = [f.name for f in d.filters if f.compression]
        if compressors:
            out.append(Advice("compressed", d.key, (
                f"{d.key!r} is compressed ({', '.join(compressors)}): decompression is what a load spends its time on, "
                f"one core per process; start the daemon with --load-processes {cores} (the cores here) so a "
                "load is split across them (loads of 64 MiB or more are split)")))
    needs: tuple[ModeNeed, ...] = report_parts["needs"]
    budget, rule = report_parts["budget"], report_parts["budget_rule"]
    shm: ShmReport = report_parts["shm"]
    checked = [n for n in needs if n.mode == (report_parts["mode"] or GLOBAL)]
    for need in checked:
        if need.fits:
            continue
        if need.mode == STREAM:
            out.append(Advice("over_budget", None, (
                f"mode 'stream' needs at least {format_bytes(need.bytes)} of shared memory on this node, one block "
                f"({need.rows:,} rows: whole chunks of every key) with a header page per key, over what a daemon "
                f"can give it ({format_bytes(budget)} budget: {rule}; {shm.path} holds {format_bytes(shm.size)}): "
                "SharedH5Dataset(mode='stream') refuses it with that daemon; raise the budget with `h5serve start "
                "--max-memory SIZE`, or rewrite the file with smaller chunks")))
            continue
        node = next((n for n in needs if n.mode == NODE and n.fits and need.mode == GLOBAL), None)
        other = (f"; or mode 'node' across more nodes (each node holds its ranks' rows: "
                 f"{format_bytes(node.bytes)} here)" if node is not None and report_parts["world_size"] >
                 report_parts["ranks_per_node"] else "")
        served = ("is streamed instead (see the stream advice)" if report_parts["stream"] is not None
                  else "is read lazily through h5py instead (slower, a copy per process)")
        out.append(Advice("over_budget", None, (
            f"mode {need.mode!r} needs {format_bytes(need.bytes)} of shared memory on this node, over the daemon's "
            f"budget of {format_bytes(budget)} ({rule}): what does not fit {served}; raise the budget with "
            f"`h5serve start --max-memory SIZE` (at most the free "
            f"space in {shm.path}: {format_bytes(shm.free)}), or grow {shm.path} "
            f"(mount -o remount,size=... {shm.path}; Docker: --shm-size){other}")))
    window: StreamWindow | None = report_parts["stream"]
    if window is not None:
        asked = report_parts["mode"] or GLOBAL
        held = held_keys(report_parts["datasets"], window)
        how = (f"SharedH5Dataset(..., mode='stream') with a daemon of this budget picks that window and block, "
               f"and holds {', '.join(held)} whole beside it ({format_bytes(window.whole_bytes)}, loaded once: "
               f"an asked window= keeps every key in blocks)" if held else
               f"SharedH5Dataset(..., mode='stream', window={window.window}, block_rows={window.block_rows})")
        pin = (f"without a daemon, window=None sizes the window (and the block) by this node's memory, ranks and "
               f"DataLoader workers instead, another order whenever that gives other blocks or another window: pass "
               f"window={window.window}, block_rows={window.block_rows} for this order with a daemon and without")
        fits = (f"the data does not fit this node's shared memory ({format_bytes(budget)} budget, {shm.path} of "
                f"{format_bytes(shm.size)})")
        if asked == STREAM:
            lead = (f"mode 'stream' with a daemon of this budget ({format_bytes(budget)}, {shm.path} of "
                    f"{format_bytes(shm.size)})")
            then = pin
        else:
            lead = f"use mode 'stream': {fits}"
            then = f"mode={asked!r} streams so automatically, with a warning"
        out.append(Advice("stream", None, (
            f"{lead}; a window of {format_bytes(window.window)} holds {window.capacity} of its {window.blocks} blocks "
            f"of {window.block_rows:,} rows ({format_bytes(window.block_bytes)}): {how}; {then}")))
    if "docker-64m" in shm.notes:
        out.append(Advice("docker_shm", None, (
            f"{shm.path} is 64 MiB, Docker's default: a container's own /dev/shm holds almost nothing and is not "
            "shared with other containers; give the daemon's container --shm-size (compose: shm_size) and share it "
            "(ipc: shareable, and ipc: \"service:h5serve\" for the trainer): docs/operations.md, Containers")))
    if "slurm-job-tmpfs" in shm.notes:
        out.append(Advice("slurm_tmpfs", None, (
            f"{shm.path} is a per-job tmpfs (SLURM job_container/tmpfs): a daemon started by the prolog, outside "
            "this job, does not see it; start the daemon inside the job as an srun step (docs/operations.md, SLURM)")))
    daemon: DaemonReport = report_parts["daemon"]
    if daemon.running and daemon.shm_visible is False:
        out.append(Advice("shm_not_shared", None, (
            f"the daemon's {daemon.shm_dir} is not the one seen here: ranks run from here would read lazily (a "
            "container without shared IPC, Docker's private /dev/shm, SLURM job_container/tmpfs, Apptainer "
            "--containall); see docs/operations.md, Shared /dev/shm pitfalls")))
    if 0 <= report_parts["nofile_hard"] < LOW_NOFILE:  # -1: unlimited
        out.append(Advice("low_nofile", None, (
            f"the open-file hard limit is {report_parts['nofile_hard']}: every rank and DataLoader worker connected "
            "to the daemon holds a descriptor of it, and near the limit it drops connections; raise it for the "
            "daemon (LimitNOFILE=65536 in its unit, ulimit -Hn)")))
    return tuple(out)


# ----- the report -------------------------------------------------------------------------
def inspect_file(
    path: str | os.PathLike[str],
    keys: list[str] | None = None,
    world_size: int = 1,
    ranks_per_node: int | None = None,
    mode: str | None = None,
    max_memory: int | None = None,
    shm_dir: str | os.PathLike[str] | None = None,
    runtime_dir: str | os.PathLike[str] | None = None,
) -> InspectReport:
    """The preflight report for ``path`` (``keys``: these datasets only; default every dataset).

    Raised when the file is missing or not HDF5: SourceNotFound; damaged or truncated: DataError.
    A URL (s3://, https://) is read through hdf5/remote.py: its errors (ObjectNotFound,
    ObjectAccessDenied, ObjectStoreError) as they are.
    Raised when a key is not a dataset there: KeyNotFound. Raised for a bad world size, ranks per node, mode or shm dir:
    ConfigError.
    """
    if world_size < 1:
        raise ConfigError(f"--world-size must be at least 1, got {world_size}")
    ranks_per_node = world_size if ranks_per_node is None else ranks_per_node
    if not 1 <= ranks_per_node <= world_size:
        raise ConfigError(f"--ranks-per-node must be in 1..{world_size} (the world size), got {ranks_per_node}")
    if mode is not None and mode not in (*ALL_MODES, STREAM):
        raise ConfigError(f"--mode must be one of {', '.join((*ALL_MODES, STREAM))}, got {mode!r}")
    remote = None
    if is_url(path):  # s3://, https://: the object as it is now (hdf5/remote.py)
        f, remote = open_remote_h5(str(path))
    else:
        f = open_h5(path)
    with f:
        names = list(keys) if keys else dataset_names(f, MAX_LISTED)
        if not names:
            raise KeyNotFound(f"{os.fspath(path)!r} holds no datasets; pass an HDF5 file with the rows to train on")
        datasets = tuple(_dataset_report(f, key) for key in names)
    shm = _shm_report(resolve_shm_dir(shm_dir))
    daemon = _daemon_report(runtime_dir)
    if max_memory is not None:
        budget, rule = max_memory, "--max-memory"
    elif daemon.running and daemon.budget is not None and daemon.shm_visible is not False:
        budget, rule = daemon.budget, f"the running daemon's, {format_bytes(daemon.used or 0)} of it in use"
    else:
        budget = int(shm.free * DEFAULT_MEMORY_FRACTION)
        rule = f"a daemon started now: {DEFAULT_MEMORY_FRACTION:.0%} of the free space in {shm.path}"
    modes = () if mode == STREAM else (mode,) if mode else ALL_MODES
    needs = mode_needs(datasets, modes, world_size, ranks_per_node, budget)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    shapes = [KeyShape(d.chunk_rows or 1, d.row_bytes, d.rows, d.vlen) for d in datasets if d.counted]
    # the window a daemon's budget holds, within the size of its shm filesystem (never what is free
    # at the moment: automatic stream mode sizes it so, client/streaming/automatic.py)
    recommended, window = recommend({n.mode: n.bytes for n in needs}, mode, world_size > ranks_per_node,
                                    min(budget, shm.size), shapes)
    if mode == STREAM:
        needs = (stream_need(window, shapes),)
    parts: dict[str, Any] = {
        "file": shown_url(str(path)) if remote else os.path.abspath(path),
        "file_bytes": remote.size if remote else os.path.getsize(path), "world_size": world_size,
        "ranks_per_node": ranks_per_node, "mode": mode, "datasets": datasets, "needs": needs, "budget": budget,
        "budget_rule": rule, "shm": shm, "daemon": daemon, "nofile_soft": _limit(soft), "nofile_hard": _limit(hard),
        "recommended_mode": recommended, "stream": window,
    }
    return InspectReport(**parts, advice=_advice(parts), remote=remote.describe() if remote else "")


def _limit(value: int) -> int:
    return -1 if value == resource.RLIM_INFINITY else int(value)
