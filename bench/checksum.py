"""What a content checksum of a segment costs: ``python -m bench.checksum``.

1. Every hash the standard library offers, over a ~300 MiB segment already in /dev/shm
   (read through a read-only mapping, as ``status --verify`` does), one thread; crc32 also
   with the threads the daemon would use (one per core, blocks joined by ``CrcKind.combine``),
   and crc32c (the crc32c package, the kind loads record where it runs in hardware).
2. Real loads of a ~300 MiB uncompressed and a gzip-compressed shard by a real daemon, with
   and without ``--no-checksum``: request to ready, and the loader's own checksum time.

Prints one JSON object; docs/performance.md quotes it.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import h5py
import numpy as np

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from h5serve.segments import data_checksum
from h5serve.util.crc import CRC32, CRC32C, CrcKind
from h5serve.wire.connection import DaemonClient
from h5serve.wire.protocol import Acquire

SIZE = 300 * 2**20
ROWS, ROW_SHAPE = 25_600, (64, 64, 3)  # 12 KiB rows: 300 MiB
REPEAT = 3


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def hashes() -> dict[str, float]:
    """GB/s of each hash over a SIZE-byte file in /dev/shm, through a read-only mapping."""
    path = Path(tempfile.mktemp(prefix="h5s-bench-cks-", dir="/dev/shm"))
    path.write_bytes(np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8).tobytes())
    out = {}
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), SIZE, prot=mmap.PROT_READ) as m:
            def stdlib(name: str) -> float:
                h = hashlib.new(name) if name != "blake2b-128" else hashlib.blake2b(digest_size=16)
                with memoryview(m) as view:
                    for off in range(0, SIZE, 32 << 20):
                        h.update(view[off:off + (32 << 20)])
                return 0.0

            def crc(threads: int, kind: CrcKind = CRC32) -> float:
                data_checksum(m, 0, SIZE, threads, kind=kind)
                return 0.0

            def adler() -> float:
                value = 1
                with memoryview(m) as view:
                    for off in range(0, SIZE, 32 << 20):
                        value = zlib.adler32(view[off:off + (32 << 20)], value)
                return 0.0

            cases = {"crc32 (zlib)": lambda: crc(1), f"crc32 (zlib), {_cores()} threads": lambda: crc(_cores()),
                     "adler32 (zlib)": adler}
            if CRC32C is not None:
                cases["crc32c (crc32c package)"] = lambda: crc(1, CRC32C)
            for name in ("md5", "sha1", "sha256", "sha512", "blake2b-128", "blake2s"):
                cases[name] = lambda name=name: stdlib(name)
            bytes(m[:: 4096])  # fault the pages in once
            for name, fn in cases.items():
                times = []
                for _ in range(REPEAT):
                    t = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t)
                out[name] = round(SIZE / min(times) / 1e9, 2)
    finally:
        path.unlink()
    return out


def _load_once(rt: Path, h5: Path, checksum: bool) -> tuple[float, float]:
    """(request to ready, the loader's checksum seconds) of one load by a fresh daemon."""
    env = {**os.environ, "H5SERVE_RUNTIME_DIR": str(rt)}
    flags = [] if checksum else ["--no-checksum"]
    subprocess.run([sys.executable, "-m", "h5serve", "start", "--log-level", "DEBUG", *flags], env=env, check=True,
                   capture_output=True, timeout=60)
    try:
        with DaemonClient(rt, timeout=60) as client:
            t = time.perf_counter()
            client.acquire(Acquire(str(h5), "x", 1, 0))
            load_s = time.perf_counter() - t
        found = re.findall(r"checksum crc32:\w+ in ([0-9.]+)s", (rt / "h5serve.log").read_text())
        return load_s, float(found[-1]) if found else 0.0
    finally:
        subprocess.run([sys.executable, "-m", "h5serve", "stop"], env=env, capture_output=True, timeout=60, check=False)


def _load(where: Path, h5: Path, checksum: bool) -> dict[str, float]:
    runs = [_load_once(where / f"rt-{int(checksum)}-{i}", h5, checksum) for i in range(REPEAT)]
    return {"load_s": round(statistics.median(r[0] for r in runs), 3),
            "checksum_s": round(statistics.median(r[1] for r in runs), 3)}


def loads() -> dict[str, dict[str, dict[str, float]]]:
    out = {}
    with tempfile.TemporaryDirectory(prefix="h5s-bench-cks-", dir="/tmp") as where:
        # compressible like real data (a ramp plus 1-bit noise), so gzip costs what it usually does
        ramp = np.arange(ROWS * int(np.prod(ROW_SHAPE)), dtype=np.int64).reshape(ROWS, *ROW_SHAPE) // 7 % 251
        rows = (ramp + np.random.default_rng(1).integers(0, 2, ramp.shape)).astype(np.uint8)
        for kind, options in (("uncompressed", {}), ("gzip", {"compression": "gzip", "compression_opts": 4})):
            h5 = Path(where) / f"{kind}.h5"
            with h5py.File(h5, "w") as f:
                f.create_dataset("x", data=rows, chunks=(256, *ROW_SHAPE), **options)
            out[kind] = {"with checksum": _load(Path(where), h5, True), "without": _load(Path(where), h5, False)}
    return out


def main() -> None:
    result = {"segment_mib": SIZE >> 20, "cores": _cores(), "hash_gb_s": hashes(), "daemon_loads": loads()}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
