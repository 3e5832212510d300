"""A segment's content checksum: computing it over large buffers (threads hash blocks, the
GF(2) combine of h5serve/util/crc.py joins them), its text form (``crc32c:...``, as ``status``
shows it), and ``verify_content``, which re-reads a published segment and tells whether
anything wrote into it after it was published.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import SegmentError
from ..util.crc import KINDS, LOAD_CRC, CrcKind
from ..util.safeio import open_regular
from .format import CHECKSUM, CHECKSUM_NONE, CHECKSUM_OFFSET, parse_header, read_header

__all__ = ["data_checksum", "checksum_text", "header_checksum", "verify_content"]

_CHECKSUM_NAMES = {CHECKSUM_NONE: "none", 1: "crc32", 2: "crc32c"}  # h5serve/util/crc.py: the kinds' codes
_CHECKSUM_BLOCK = 32 * 1024 * 1024  # bytes per hash call: threads hash blocks, CrcKind.combine joins them


def data_checksum(buffer: Any, offset: int, length: int, threads: int = 1,
                  progress: Callable[[int], None] | None = None, kind: CrcKind = LOAD_CRC) -> int:
    """``kind``'s crc of ``buffer[offset:offset + length]``, hashed in blocks by up to
    ``threads`` threads (both kinds release the GIL); ``progress(bytes)`` after each block."""
    starts = list(range(offset, offset + length, _CHECKSUM_BLOCK))
    with memoryview(buffer) as view:  # released on return, so the caller can close its mapping

        def one(start: int) -> int:
            end = min(start + _CHECKSUM_BLOCK, offset + length)
            with view[start:end] as block:
                crc = kind.update(block, 0)
            if progress is not None:
                progress(end - start)
            return crc

        if threads > 1 and len(starts) > 1:
            with ThreadPoolExecutor(min(threads, len(starts)), thread_name_prefix="h5serve-crc") as pool:
                crcs = list(pool.map(one, starts))
        else:
            crcs = [one(start) for start in starts]
    total = 0
    for start, crc in zip(starts, crcs):
        total = kind.combine(total, crc, min(_CHECKSUM_BLOCK, offset + length - start))
    return total


def checksum_text(code: int, value: bytes) -> str:
    """``crc32:1a2b3c4d`` or ``crc32c:...`` (the form ``status`` shows), or "" when there is none."""
    name = _CHECKSUM_NAMES.get(code)
    if code == CHECKSUM_NONE or name is None:
        return ""
    return f"{name}:{struct.unpack_from('<I', value)[0]:08x}"


def header_checksum(header: bytes) -> str:
    """The checksum a segment header records (``crc32:...``), or "" when it has none."""
    kind, value = CHECKSUM.unpack_from(header, CHECKSUM_OFFSET)
    return checksum_text(kind, value)


def verify_content(path: Path, expected: str = "", threads: int = 1, fd: int | None = None) -> str:
    """Re-read a published segment's rows and compare them with the checksum its header
    records (and with ``expected``, the daemon's record, when given). Returns "" when they
    match, else what does not. ``fd``: a descriptor of it already opened (the daemon hands
    its other users one: handout.py), closed here; else ``path`` is opened.

    Raised when it cannot be opened or is not a valid complete segment: SegmentError.
    """
    if fd is None:
        fd, st = open_regular(path, SegmentError)
    else:
        st = os.fstat(fd)
    try:
        header = read_header(fd)
        meta, complete = parse_header(header, f"segment {path}")
        if not complete or st.st_size != meta.file_size:
            return f"it is {st.st_size} bytes for {meta.file_size} expected, or incomplete (truncated or rewritten)"
        recorded = header_checksum(header)
        if expected and recorded != expected:
            return f"its header records checksum {recorded or 'none'}, the daemon recorded {expected}"
        if not recorded:
            return ""  # loaded without a checksum: nothing to compare with
        code = CHECKSUM.unpack_from(header, CHECKSUM_OFFSET)[0]
        kind = KINDS.get(code)
        if kind is None:
            return (f"its header records a {recorded.split(':')[0]} checksum, which this h5serve cannot compute "
                    f"(python -m pip install crc32c)")
        with mmap.mmap(fd, meta.file_size, mmap.MAP_SHARED, mmap.PROT_READ) as buffer:
            crc = data_checksum(buffer, meta.header_size, meta.nbytes, threads, kind=kind)
    finally:
        os.close(fd)
    actual = kind.text(crc)
    if actual == recorded:
        return ""
    return f"its rows have checksum {actual}, not the {recorded} recorded when it was loaded"
