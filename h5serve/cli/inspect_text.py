"""``h5serve inspect``'s report (cli/inspect_report.py) as text for a terminal. The file's
path, its keys, dtypes and filter names are whoever wrote the file's (inspecting another
user's file is what the command is for): they are escaped as the log escapes them
(util/logtext.py ``printable``), every line of the report one line; ``--json`` keeps them exact."""

from __future__ import annotations

from ..order.sharding import GLOBAL, NODE, STREAM
from ..util.logtext import printable
from ..util.units import format_bytes
from .inspect_report import DatasetReport, InspectReport, held_keys

__all__ = ["format_report"]


def _dataset_line(d: DatasetReport) -> list[str]:
    shape = "x".join(str(n) for n in d.row_shape)
    if d.chunk_rows is not None:
        plural = "s" if d.chunk_rows != 1 else ""
        layout = f"chunks of {d.chunk_rows:,} row{plural} ({format_bytes(d.chunk_bytes or 0)})"
    else:
        layout = d.layout
    filters = ", ".join(f.name + ("" if f.available else " (MISSING plugin)") for f in d.filters) or "no filters"
    dtype = "compound" if d.dtype.startswith("[") else d.dtype
    cells = [d.key, f"{d.rows:,}", f"{shape} {dtype}".strip(), format_bytes(d.nbytes), layout, filters]
    return cells + (["NOT SERVABLE"] if d.problem and all(f.available for f in d.filters) else [])


def _table(rows: list[list[str]]) -> list[str]:
    rows = [[printable(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(max(len(r) for r in rows))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _not_fitting(report: InspectReport, mode: str) -> str:
    if mode == STREAM:
        return "NO: not one block"
    return "NO: streamed" if report.stream is not None and mode in (GLOBAL, NODE) else "NO: lazy reads"


def format_report(report: InspectReport) -> str:
    """The report as text for a terminal."""
    lines = [f"{printable(report.file)} ({format_bytes(report.file_bytes)})", "datasets:"]
    if report.remote:
        lines[1:1] = [f"remote object: {report.remote}; a daemon fetches an s3:// object of fixed-size rows once per "
                      "node (global, node, contiguous, interleave; --allow-url on a shared daemon), else each process "
                      "reads it through fsspec"]
    lines += _table([["key", "rows", "row", "size", "layout", "filters"], *map(_dataset_line, report.datasets)])
    where = (f"world size {report.world_size}, {report.ranks_per_node} of its ranks on this node"
             if report.world_size > 1 else "one rank")
    lines.append(f"shared memory on this node ({where}; source dtypes; budget {format_bytes(report.budget)}: "
                 f"{report.budget_rule}):")
    lines += _table([["mode", "rows", "memory", "fits"],
                     *[[n.mode, f"{n.rows:,}", format_bytes(n.bytes), "yes" if n.fits else _not_fitting(report, n.mode)]
                       for n in report.needs]])
    if report.stream is None:
        lines.append(f"recommended: mode {report.recommended_mode!r}")
    else:
        w = report.stream
        held = held_keys(report.datasets, w)
        beside = f"; {printable(', '.join(held))} held whole beside it, {format_bytes(w.whole_bytes)}" if held else ""
        lines.append(f"recommended: mode 'stream', window {format_bytes(w.window)} ({w.capacity} of {w.blocks} blocks "
                     f"of {w.block_rows:,} rows, {format_bytes(w.block_bytes)} each{beside})")
    shm = report.shm
    notes = {"docker-64m": "Docker's default 64 MiB", "slurm-job-tmpfs": "a SLURM per-job tmpfs"}
    lines.append(f"{printable(shm.path)}: {format_bytes(shm.size)}, {format_bytes(shm.free)} free"
                 + "".join(f"; {notes[n]}" for n in shm.notes))
    d = report.daemon
    if d.running:
        seen = {True: "visible from here", False: "NOT visible from here", None: "visibility unknown"}[d.shm_visible]
        lines.append(f"daemon: pid {d.pid} on {printable(d.runtime_dir)}, shm {printable(d.shm_dir)} {seen} "
                     f"({printable(d.how)})")
    else:
        lines.append(f"daemon: not running on {printable(d.runtime_dir)}")
    soft = "unlimited" if report.nofile_soft < 0 else str(report.nofile_soft)
    hard = "unlimited" if report.nofile_hard < 0 else str(report.nofile_hard)
    lines.append(f"open files: soft limit {soft}, hard limit {hard}")
    if report.advice:
        lines.append("advice:")
        lines += [f"- {printable(a.text)}" for a in report.advice]
    else:
        lines.append("advice: none; the layout suits h5serve")
    return "\n".join(lines)
