"""Unit tests for the command line's text for a terminal (``h5serve status``, ``status --verify``,
``inspect``): a file name or key with ESC, CR, BEL or a newline (another user's) reaches the
terminal escaped, as the log escapes it, and never makes a line of its own."""

from __future__ import annotations

import re
from typing import Any

from h5serve.cli.inspect_report import (
    Advice,
    DaemonReport,
    DatasetReport,
    FilterReport,
    InspectReport,
    ModeNeed,
    ShmReport,
)
from h5serve.cli.inspect_text import format_report
from h5serve.cli.status import format_status, format_verify

FORGED_ROW = "/data/secret.h5  x  all  global  float32  1.0 GiB  0  0  1s  ready"
HOSTILE_FILE = f"/pub/a\x1b]0;owned\x07\r\n{FORGED_ROW}\n.h5"
HOSTILE_KEY = "k\x1b[2J\x07\r\nx"
CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # every control but the newline between lines


def _segment(file: str, key: str) -> dict[str, Any]:
    return {"name": "h5serve-0-abc", "file": file, "files": [file], "key": key, "rank": 0, "world_size": 1,
            "mode": "global", "selection": "0:10", "whole_file": True, "dtype": "float32", "rows": 10,
            "rows_done": 10, "bytes": 4096, "state": "ready", "hits": 1, "holders": 0, "age_s": 1.0}


def _info(*segments: dict[str, Any]) -> dict[str, Any]:
    return {"version": "1.0", "pid": 1, "runtime_dir": "/run/h5serve", "shm_dir": "/dev/shm",
            "memory": {"used": 4096, "budget": 1 << 30, "shm_free": 1 << 30}, "segments": list(segments)}


def test_status_escapes_file_names_and_keys_and_forges_no_row() -> None:
    text = format_status(_info(_segment(HOSTILE_FILE, HOSTILE_KEY), _segment("/pub/plain.h5", "x")))
    lines = text.split("\n")
    assert not CONTROLS.search(text), repr(text)
    assert len(lines) == 3 + 1 + 2, lines  # the daemon, memory, stream; the header; one row per segment
    assert not [line for line in lines if line.startswith("/data/secret.h5")], lines
    row = next(line for line in lines if line.startswith("/pub/a"))
    assert row.startswith("/pub/a\\x1b]0;owned\\x07\\x0d\\x0a/data/secret.h5"), row
    assert "k\\x1b[2J\\x07\\x0d\\x0ax" in row, row
    assert any(re.match(r"/pub/plain\.h5 +x +all ", line) for line in lines), lines  # plain names as they are


def test_status_verify_escapes_damaged_segments() -> None:
    damaged = {k: v for k, v in _segment(HOSTILE_FILE, HOSTILE_KEY).items()
               if k in ("name", "file", "key", "rank", "world_size")} | {"problem": "rows differ\x1b[0m"}
    report = {"checked": 1, "bytes": 4096, "seconds": 0.1, "unchecked": 0, "gone": 0, "damaged": [damaged]}
    text = format_verify(report, "/dev/shm")
    assert not CONTROLS.search(text), repr(text)
    assert len(text.split("\n")) == 3, text  # the summary, the segment, what to do
    assert not [line for line in text.split("\n") if line.startswith("/data/secret.h5")], text


def test_inspect_text_escapes_the_files_keys_and_filter_names() -> None:
    hostile_filter = FilterReport(32000, "lzf\x1b]0;t\x07", False, True)
    dataset = DatasetReport(key=HOSTILE_KEY, rows=10, row_shape=(4,), dtype="float32", nbytes=160, layout="chunked",
                            chunk_rows=5, chunk_bytes=80, filters=(hostile_filter,), problem="")
    report = InspectReport(
        file=HOSTILE_FILE, file_bytes=4096, world_size=1, ranks_per_node=1, mode=None, datasets=(dataset,),
        needs=(ModeNeed("global", 10, 8192, True),), budget=1 << 30, budget_rule="half of shm",
        shm=ShmReport("/dev/shm", 1 << 30, 1 << 30, ()), daemon=DaemonReport("/run/h5serve", False),
        nofile_soft=1024, nofile_hard=4096, recommended_mode="global", stream=None,
        advice=(Advice("missing_filter", HOSTILE_KEY, f"{HOSTILE_KEY} needs a filter\r\n- FORGED advice"),))
    text = format_report(report)
    lines = text.split("\n")
    assert not CONTROLS.search(text), repr(text)
    assert not [line for line in lines if line.startswith(("/data/secret.h5", "- FORGED"))], lines
    assert lines[0].startswith("/pub/a\\x1b]0;owned\\x07\\x0d\\x0a/data/secret.h5"), lines
    assert any("k\\x1b[2J\\x07\\x0d\\x0ax" in line and "lzf\\x1b]0;t\\x07 (MISSING plugin)" in line for line in lines)
