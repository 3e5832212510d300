"""``h5serve status``'s text: the segment table, and ``--verify``'s re-read of every segment
against the checksum recorded at load time (``cmd_status`` runs the command).

Paths and keys are the members' (a root or service-account daemon shows everyone's to root):
the text escapes them as the log does (util/logtext.py ``printable``), so an ESC, CR, BEL or
newline in a file name or key never reaches the terminal raw; ``--json`` keeps them exact."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from ..errors import DaemonUnavailable, SegmentError
from ..segments import verify_content
from ..segments.handout import opens_by_name, request_descriptor
from ..util.logtext import printable, printable_lines
from ..util.units import format_bytes
from ..wire.runtime import HANDOUT_SOCKET_NAME
from .common import EXIT_ERROR, EXIT_NOT_RUNNING, EXIT_OK, daemon_client

__all__ = ["cmd_status", "format_status", "format_verify", "verify_segments"]


def shown_file(segment: dict[str, Any]) -> str:
    """The file column: the file, or a multi-file dataset's first and last files and their count."""
    files = segment.get("files") or [segment["file"]]
    if len(files) == 1:
        return files[0]
    return f"{files[0]} .. {os.path.basename(files[-1])} ({len(files)} files)"


def _first_row(segment: dict[str, Any]) -> int:
    try:
        return int(str(segment.get("selection", "0")).split(":")[0])
    except ValueError:
        return 0


def shown_ranks(segment: dict[str, Any]) -> str:
    """The ranks column: ``all`` (the whole file), ``rank/world size``, or for a stream-mode
    block the global rows it holds (``rows 4096-8191``): every rank of the node reads it."""
    if segment.get("whole_file"):
        return "all"
    if segment["mode"] == "stream":
        start, stop = (int(v) for v in str(segment["selection"]).split(":")[:2])
        return f"rows {start}-{stop - 1}"
    return f"{segment['rank']}/{segment['world_size']}"


def format_status(info: dict[str, Any]) -> str:
    """The daemon, its memory and one row per segment, every string from the daemon escaped
    (``printable``): each segment is one line however its file and key are named."""
    mem = info["memory"]
    lines = [
        f"h5serve {printable(info['version'])} pid {info['pid']} on {printable(info['runtime_dir'])} "
        f"(shm {printable(info['shm_dir'])})",
        f"memory: {format_bytes(mem['used'])} used of {format_bytes(mem['budget'])} budget "
        f"({printable(mem.get('budget_rule', '--max-memory'))}); "
        f"{format_bytes(mem['shm_free'])} free in shm",
        f"stream: mode='stream' with window=None streams through a window of the budget, "
        f"{format_bytes(mem['budget'])}, shared by the node's ranks (less the small keys it holds whole: labels)",
    ]
    idle = info.get("idle_exit")
    if idle:
        lines.append(f"idle exit: after {idle['after_s']:g}s unused (--idle-exit); unused for {idle['idle_s']:.0f}s "
                     "(status requests do not count)"
                     + (f"; {idle['holds']} hold(s) of running jobs" if idle.get("holds") else ""))
    arenas = info.get("arenas")
    if arenas and (arenas.get("arenas") or arenas.get("loads")):
        lines.append(f"stream arenas: {arenas['arenas']} open, {arenas['ready']} of {arenas['slots']} slot(s) "
                     f"ready, {format_bytes(arenas['bytes'])}; {arenas['loads']} block load(s), "
                     f"{arenas['reclaims']} slot(s) reused, {arenas['punches']} given back")
    remote = info.get("remote")
    if remote and remote.get("loads"):
        lines.append(f"remote: {remote['loads']} load(s) of s3:// objects fetched "
                     f"{format_bytes(remote['fetched_bytes'])} in {remote['fetch_seconds']:.1f}s "
                     f"({remote['bytes_per_s'] / 1e6:.1f} MB/s)")
    segments = info["segments"]
    if not segments:
        lines.append("no segments")
        return "\n".join(lines)
    header = ("file", "key", "ranks or rows", "mode", "dtype", "size", "holders", "hits", "age", "state")
    rows = [
        tuple(map(printable, (
            shown_file(s), s["key"], shown_ranks(s),
            "global" if s.get("whole_file") else s["mode"], s["dtype"], format_bytes(s["bytes"]),
            str(s.get("holders", 0)), str(s["hits"]), format_age(s["age_s"]),
            s["state"] if s["state"] != "loading" else f"loading {100 * s['rows_done'] // max(s['rows'], 1)}%")))
        for s in sorted(segments, key=lambda s: (s["file"], s["key"], s["mode"] == "stream", s["world_size"], s["rank"],
                                                 _first_row(s)))
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)


def format_age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def verify_segments(info: dict[str, Any], runtime_dir: str | os.PathLike[str] | None = None,
                    owner: int | None = None) -> dict[str, Any]:
    """Re-read every published segment and compare its rows with the checksum the daemon
    recorded when it loaded them: ``{"checked", "bytes", "seconds", "unchecked", "gone", "damaged"}``.
    A user who may not open the daemon's segments by name (a ``--group`` member: ``owner`` is
    the daemon's uid) reads each through the descriptor the daemon hands it (``runtime_dir``)."""
    report: dict[str, Any] = {"checked": 0, "bytes": 0, "unchecked": 0, "gone": 0, "damaged": []}
    started = time.monotonic()
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    for seg in info["segments"]:
        if seg["state"] == "loading":
            continue
        path = Path(info["shm_dir"]) / seg["name"]
        try:
            fd = None
            if owner is not None and runtime_dir is not None and not opens_by_name(owner):
                fd = request_descriptor(Path(runtime_dir) / HANDOUT_SOCKET_NAME, seg["name"], owner)
            problem = verify_content(path, seg.get("checksum", ""), threads, fd)
        except SegmentError as exc:
            if not os.path.lexists(path):  # evicted or stopped since `status` answered
                report["gone"] += 1
                continue
            problem = str(exc)
        report["checked"] += 1
        report["bytes"] += seg["bytes"]
        if not problem and not seg.get("checksum"):
            report["unchecked"] += 1  # loaded with --no-checksum: nothing to compare with
        if problem:
            report["damaged"].append({k: seg[k] for k in ("name", "file", "key", "rank", "world_size")}
                                     | {"problem": problem})
    report["seconds"] = round(time.monotonic() - started, 3)
    return report


def format_verify(report: dict[str, Any], shm_dir: str) -> str:
    summary = (f"verified {report['checked']} segments ({format_bytes(report['bytes'])}) in {report['seconds']:.2f}s"
               + (f", {report['unchecked']} loaded without a checksum" if report["unchecked"] else "")
               + (f", {report['gone']} gone meanwhile" if report["gone"] else ""))
    if not report["damaged"]:
        return summary + ": every one matches what was loaded"
    lines = [summary + f": {len(report['damaged'])} DAMAGED"]
    for d in report["damaged"]:
        lines.append(f"  {printable(d['name'])} ({printable(d['file'])}[{printable(d['key'])}] "
                     f"rank {d['rank']}/{d['world_size']}): {printable(d['problem'])}")
    names = " ".join(printable(Path(shm_dir) / d["name"]) for d in report["damaged"])
    lines.append("Something wrote into these after they were loaded; jobs that use them read wrong rows. Remove "
                 f"them (as the daemon's user or root: rm {names}) so the daemon loads them again at the next "
                 "request, and restart the jobs that use them (they keep the damaged copy they mapped).")
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    with daemon_client(args.runtime_dir) as client:
        try:
            info = client.status()
        except DaemonUnavailable as exc:
            stopped = {"running": False, "runtime_dir": str(client.location.directory)}
            print(json.dumps(stopped) if args.json else printable_lines(str(exc)))
            return EXIT_NOT_RUNNING
    report = verify_segments(info, client.location.directory, client.daemon_uid) if args.verify else None
    if args.json:
        print(json.dumps({"running": True, **info, **({"verify": report} if report is not None else {})}, indent=2))
    else:
        print(format_status(info))
        if report is not None:
            print(format_verify(report, info["shm_dir"]))
    return EXIT_ERROR if report is not None and report["damaged"] else EXIT_OK
