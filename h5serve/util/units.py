"""Sizes in bytes: as people write and read them (``parse_size("16G")`` and its inverse
``format_bytes``), the size of one row (``row_nbytes``), of the page in front of a segment's
rows (``SEGMENT_HEADER_BYTES``) and the memory a file of some size takes in tmpfs
(``allocated_bytes``: whole pages, what the daemon's budget counts). Shared by the command
line, the daemon and the client (torch-free, daemon-free)."""

from __future__ import annotations

import mmap
import re

import numpy as np

from ..errors import ConfigError

__all__ = ["parse_size", "format_bytes", "row_nbytes", "allocated_bytes", "PAGE_BYTES", "SEGMENT_HEADER_BYTES"]

# A segment's header: one page in front of its rows, so that the rows start page-aligned. The
# segment format is segments/format.py (its HEADER_SIZE); defined here because stream mode's
# plan (order/stream_plan.py), below the segments in the layers, counts one per block and key.
SEGMENT_HEADER_BYTES = 4096
# tmpfs (/dev/shm) gives a file its memory a page at a time: a segment of 4,097 bytes takes two
PAGE_BYTES = mmap.PAGESIZE

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'64G', '512MiB', '1.5T', '1000000' -> bytes (binary multiples).

    Raised when it is not a size: ConfigError.
    """
    match = _SIZE.match(str(text))
    if not match:
        raise ConfigError(f"{text!r} is not a size; use e.g. 512M, 16G or a number of bytes")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** " kmgtp".index(unit or " "))


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary multiples; whole bytes below 1 KiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def row_nbytes(row_shape: tuple[int, ...], dtype: np.dtype) -> int:
    """Bytes of one row of ``row_shape`` elements of ``dtype`` (C-contiguous)."""
    return int(np.prod(row_shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def allocated_bytes(size: int) -> int:
    """The memory a file of ``size`` bytes takes in tmpfs once every byte is written or
    reserved: whole pages (PAGE_BYTES). What a segment costs in the daemon's budget."""
    return -(-size // PAGE_BYTES) * PAGE_BYTES
