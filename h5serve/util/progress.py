"""Progress of a load: a tqdm bar on a terminal, a plain line every few seconds otherwise
(batch logs and SLURM output files have no use for carriage returns)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["Progress", "LOG_INTERVAL_S"]

LOG_INTERVAL_S = 5.0


class Progress:
    def __init__(
        self,
        description: str,
        total: int,
        emit: Callable[[str], None],
        stream: TextIO | None = None,
        interval: float = LOG_INTERVAL_S,
    ) -> None:
        self.description = description
        self.total = max(int(total), 0)
        self.emit = emit
        self.interval = interval
        self._bar: Any = None
        self._last = time.monotonic()
        self._done = 0
        stream = sys.stderr if stream is None else stream
        if _isatty(stream):
            try:
                from tqdm import tqdm
            except ImportError:  # the progress extra is optional: fall back to lines
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=self.total, desc=description, unit="rows", unit_scale=True, file=stream,
                                 leave=False, dynamic_ncols=True)

    def update(self, done: int) -> None:
        done = min(max(int(done), 0), self.total)
        if self._bar is not None:
            self._bar.update(done - self._done)
        elif time.monotonic() - self._last >= self.interval:
            self._last = time.monotonic()
            pct = 100.0 * done / self.total if self.total else 100.0
            self.emit(f"{self.description}: {pct:.0f}% ({done}/{self.total} rows)")
        self._done = done

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
