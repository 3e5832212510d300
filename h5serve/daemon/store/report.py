"""What ``h5serve status`` shows of the store's segments: one dict per segment, and which
segments a viewer may see (a ``--group`` member only those it was granted)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from ...segments import count_leases, read_progress
from .entries import Entry, shown_state

__all__ = ["visible_to", "segments_status"]


def visible_to(entries: Iterable[Entry], viewer: int | None) -> list[Entry]:
    """Every entry for the daemon's own user, root and the daemon itself (``viewer`` None);
    for another uid only the entries it was granted."""
    return [e for e in entries if viewer is None or viewer in (os.geteuid(), 0) or viewer in e.granted]


def segments_status(entries: list[Entry], shm_dir: Path) -> list[dict[str, Any]]:
    """``status``'s row of each entry: file, key, ranks, mode, dtype, sizes (the file's, what the
    budget counts), state, holders
    (shared leases, from /proc/locks), hits, age and how its load went."""
    rows = []
    now = time.time()
    holders = count_leases([shm_dir / e.file for e in entries if e.state != "loading"])
    for entry in entries:
        m = entry.meta
        done = m.rows if entry.state != "loading" else (
            read_progress(shm_dir / entry.tmp_name)[0] if entry.process else 0)
        mode, world_size, rank = entry.label()
        rows.append({
            "name": entry.file, "file": m.source_path, "files": [f[0] for f in m.files] or [m.source_path],
            "key": m.key, "rank": rank,
            "world_size": world_size, "mode": mode, "modes": sorted(entry.modes or {m.mode}),
            "selection": str(m.row_range), "whole_file": m.row_range.covers(m.total_rows),
            "dtype": str(m.np_dtype) if not m.vlen else  # variable-length rows: "vlen float32", "str utf-8"
            f"vlen {m.np_dtype}" if m.vlen == "seq" else f"str {m.vlen}",
            "source_dtype": str(np.dtype(m.source_dtype)),
            # bytes: the file's size; charged: what the budget counts for it (its pages in tmpfs, or the room
            # of a variable-length load in flight)
            "rows": m.rows, "rows_done": done, "bytes": m.file_size, "charged": entry.charge,
            "state": shown_state(entry, shm_dir),
            "hits": entry.hits, "holders": holders.get(shm_dir / entry.file, 0),
            "age_s": round(now - entry.created, 3), "load_s": round(entry.load_seconds, 3),
            "load_read_s": round(entry.load_read_seconds, 4),
            "load_parts": entry.load_parts,
            "load_copied_bytes": entry.load_copied_bytes,
            "checksum": entry.checksum,
        })
    return rows
