"""The content checksums a segment header can record: crc32 (zlib) and crc32c (Castagnoli).

A load hashes every row it writes (daemon/loading/loadcrc.py) so that ``h5serve status --verify``
can tell later whether anything wrote into a published segment. zlib's crc32 runs at ~2 GB/s
on these machines, slower than the kernel copies a load (~3 GB/s): hashing set the pace of
every load. The ``crc32c`` package computes CRC-32C with the CPU's crc32 instruction
(SSE 4.2, ARMv8) at ~14 GB/s and releases the GIL, so loads record crc32c wherever that
package runs in hardware, and crc32 otherwise (its software crc32c is slower than zlib).
A segment records which kind it holds; ``verify`` recomputes that kind.

Both are reflected CRCs with all-ones init and final xor, so one GF(2) combine serves both:
``combine(crc(A), crc(B), len(B)) == crc(A + B)`` lets threads and loader processes hash
parts of one buffer and join them in order (zlib's crc32_combine, which Python's zlib does
not expose).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CRC32", "CRC32C", "KINDS", "LOAD_CRC", "CrcKind"]

_crc32c: Any
try:  # a dependency, but without its wheel (or without the instruction) loads record crc32
    import crc32c as _crc32c
except ImportError:  # pragma: no cover - installed with h5serve where a wheel exists
    _crc32c = None


def _x_pow_2n_table(poly: int) -> tuple[int, ...]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _gf2_multiply(p, p, poly)
    return tuple(table)


def _gf2_multiply(a: int, b: int, poly: int) -> int:
    """a * b modulo ``poly`` (reflected bit order), as zlib's multmodp."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ poly if b & 1 else b >> 1


@dataclass(frozen=True)
class CrcKind:
    """One checksum kind: its code in a segment header, its name in ``status``, its reflected
    polynomial and the function that extends a crc over more bytes (``update(data, crc)``)."""

    code: int
    name: str
    poly: int
    update: Callable[[Any, int], int]
    _x2n: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_x2n", _x_pow_2n_table(self.poly))

    def combine(self, crc1: int, crc2: int, len2: int) -> int:
        """The crc of A + B from crc(A), crc(B) and len(B)."""
        p, k, n = 1 << 31, 3, len2  # x^0; a byte is x^8 = x^(2^3)
        while n:
            if n & 1:
                p = _gf2_multiply(self._x2n[k & 31], p, self.poly)
            n >>= 1
            k += 1
        return _gf2_multiply(p, crc1, self.poly) ^ crc2

    def text(self, crc: int) -> str:
        """``crc32:1a2b3c4d``: the form ``status`` shows and the daemon records."""
        return f"{self.name}:{crc:08x}"


def _crc32c_update(data: Any, crc: int = 0) -> int:
    assert _crc32c is not None
    return int(_crc32c.crc32c(data, crc))


CRC32 = CrcKind(1, "crc32", 0xEDB88320, zlib.crc32)
CRC32C: CrcKind | None = CrcKind(2, "crc32c", 0x82F63B78, _crc32c_update) if _crc32c is not None else None
KINDS: dict[int, CrcKind] = {kind.code: kind for kind in (CRC32, CRC32C) if kind is not None}
# what loads record: crc32c where the crc32 instruction computes it, else zlib's crc32
LOAD_CRC: CrcKind = CRC32C if CRC32C is not None and getattr(_crc32c, "hardware_based", False) else CRC32
