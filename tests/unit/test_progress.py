"""Load progress: a tqdm bar on a real terminal (pty), plain lines otherwise."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import select
import struct
import termios
import time

from h5serve.util.progress import Progress


def test_bar_on_a_terminal() -> None:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100-column terminal
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            lines: list[str] = []
            bar = Progress("loading x", 1000, lines.append, stream=tty)
            for done in (100, 500, 1000):
                time.sleep(0.15)  # tqdm redraws at most every 0.1 s, as a real load would be seen
                bar.update(done)
            bar.close()
            tty.flush()
        output = ""
        while select.select([master], [], [], 2)[0]:  # never block: a silent bar fails, not hangs
            chunk = os.read(master, 65536).decode(errors="replace")
            output += chunk
            if not chunk or "1.00k/1.00k" in output:
                break
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
