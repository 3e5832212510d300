"""Load progress: a tqdm bar on a real terminal (pty), plain lines otherwise."""

from __future__ import annotations

import io
import os
import pty

from h5serve.progress import Progress


def test_bar_on_a_terminal() -> None:
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            lines: list[str] = []
            bar = Progress("loading x", 1000, lines.append, stream=tty)
            for done in (100, 500, 1000):
                bar.update(done)
            bar.close()
            tty.flush()
        output = os.read(master, 65536).decode(errors="replace")
    finally:
        os.close(master)
        os.close(slave)
    assert "loading x" in output and "1.00k/1.00k" in output and "\r" in output
    assert lines == []  # no duplicate log lines when a bar is shown


def test_lines_when_not_a_terminal() -> None:
    lines: list[str] = []
    bar = Progress("loading y", 200, lines.append, stream=io.StringIO(), interval=0.0)
    bar.update(50)
    bar.update(500)  # clamped to the total
    bar.close()
    assert lines == ["loading y: 25% (50/200 rows)", "loading y: 100% (200/200 rows)"]
    quiet: list[str] = []
    rare = Progress("loading z", 10, quiet.append, stream=io.StringIO(), interval=3600)
    rare.update(5)
    assert quiet == []  # at most one line per interval
