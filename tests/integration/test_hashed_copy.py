"""A load's checksum is computed from the bytes on their way into the segment (daemon/loading/loadcrc.py):
rows copied file to file through a small buffer, rows read through h5py in the staging buffer.

Whatever path each block takes (copied, read through h5py for an unallocated chunk, strided
for an interleaved shard, decompressed, one part of a split load, many files), the hash sees
every byte of the rows written, once, in row order: the crc equals the crc of the rows
computed by the hashing library itself. End to end, ``status`` shows exactly that crc for
loads by one and by two processes, interleaved shards and many files.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5serve.daemon.loading.loadcrc import RunningCrc
from h5serve.hdf5.rawcopy import FileCopier
from h5serve.hdf5.reads import ShardWrite, read_shard_into
from h5serve.hdf5.source import inspect_dataset
from h5serve.order.sharding import RowRange, Selection
from h5serve.util.crc import LOAD_CRC
from h5serve.wire.connection import DaemonClient
from h5serve.wire.protocol import Acquire

from ..helpers import Daemon, expected_checksum, short_workdir

pytestmark = pytest.mark.timeout(120)

ROWS, SHAPE, CHUNK = 1000, (3, 8, 8), 64


def rows_for(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, *SHAPE), dtype=np.uint8)


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    with short_workdir("h5s-hash-") as where:
        with h5py.File(where / "plain.h5", "w") as f:
            f.create_dataset("x", data=rows_for(ROWS), chunks=(CHUNK, *SHAPE))
            f.create_dataset("contiguous", data=rows_for(ROWS, 1))
            f.create_dataset("gzip", data=rows_for(ROWS, 2), chunks=(CHUNK, *SHAPE), compression="gzip")
            holes = f.create_dataset("holes", (ROWS, *SHAPE), dtype="uint8", chunks=(CHUNK, *SHAPE), fillvalue=7)
            holes[: 5 * CHUNK] = rows_for(5 * CHUNK, 3)  # chunks past the fifth were never written
            holes[9 * CHUNK:] = rows_for(ROWS - 9 * CHUNK, 4)
        for i in range(2):
            with h5py.File(where / f"part{i}.h5", "w") as f:
                f.create_dataset("x", data=rows_for(300 + 100 * i, 10 + i), chunks=(CHUNK, *SHAPE))
        yield where


def _hashed_read(path: Path, key: str, rows: RowRange | Selection, span: tuple[int, int] | None = None,
                 write_behind: bool = False) -> tuple[np.ndarray, str]:
    """The rows read into a fresh /dev/shm file as a load reads them, and the crc of what the hash saw."""
    with h5py.File(path, "r") as f:
        info = inspect_dataset(f, key)
        count = len(rows.rows(info.rows)) if isinstance(rows, Selection) else len(rows)
        out = np.zeros((count, *info.row_shape), dtype=info.dtype)
        target = f"/dev/shm/h5s-hash-{os.getpid()}"
        fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(fd, 0, out.nbytes)
            crc = RunningCrc()
            read_shard_into(f[key], info, rows, out, span=span,
                            how=ShardWrite((fd, 0), crc.update, write_behind=write_behind))
            written = np.frombuffer(os.pread(fd, out.nbytes, 0), dtype=info.dtype).reshape(out.shape)
        finally:
            os.close(fd)
            os.unlink(target)
    return written, LOAD_CRC.text(crc.value)


@pytest.mark.parametrize("write_behind", [False, True], ids=["inline", "write-behind"])
@pytest.mark.parametrize("key", ["x", "contiguous", "gzip", "holes"])
@pytest.mark.parametrize("rows", [Selection("contiguous", 1, 0), Selection("interleave", 3, 1),
                                  Selection("contiguous", 3, 2)], ids=["whole", "interleave", "last-third"])
def test_the_hash_sees_exactly_the_rows_written(work: Path, key: str, rows: Selection, write_behind: bool) -> None:
    written, crc = _hashed_read(work / "plain.h5", key, rows, write_behind=write_behind)
    with h5py.File(work / "plain.h5", "r") as f:
        r = rows.rows(ROWS)
        expected = f[key][:][r.start:r.stop:r.step]
    assert np.array_equal(written, expected)
    assert crc == expected_checksum(expected.tobytes())


def test_a_part_hashes_its_own_rows(work: Path) -> None:
    whole = RowRange(0, ROWS, 1)
    written, crc = _hashed_read(work / "plain.h5", "holes", whole, span=(3 * CHUNK, 11 * CHUNK))
    with h5py.File(work / "plain.h5", "r") as f:
        expected = f["holes"][3 * CHUNK:11 * CHUNK]
    assert crc == expected_checksum(expected.tobytes())
    assert np.array_equal(written[3 * CHUNK:11 * CHUNK], expected)


@pytest.mark.parametrize(("splice", "write_behind"), [(True, False), (False, False), (True, True)],
                         ids=["splice", "buffered", "write-behind"])
def test_a_hashed_copy_passes_every_byte_in_order(work: Path, splice: bool, write_behind: bool) -> None:
    data = (work / "plain.h5").read_bytes()
    seen: list[bytes] = []
    target = f"/dev/shm/h5s-hash-{os.getpid()}"
    fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with open(work / "plain.h5", "rb") as src, \
                FileCopier(buffer_bytes=5000, splice=splice, write_behind=write_behind) as copier:
            copier.copy(src.fileno(), 123, len(data) - 200, fd, 10, lambda piece: seen.append(bytes(piece)))
            copier.finish()
        assert os.pread(fd, len(data), 10) == data[123:-77]
    finally:
        os.close(fd)
        os.unlink(target)
    assert b"".join(seen) == data[123:-77]
    assert max(len(piece) for piece in seen) <= 5000


def test_a_failed_write_behind_is_an_error(work: Path) -> None:
    target = f"/dev/shm/h5s-hash-{os.getpid()}"
    with open(target, "wb"):
        pass
    read_only = os.open(target, os.O_RDONLY)  # every pwrite fails (EBADF)
    try:
        with open(work / "plain.h5", "rb") as src, FileCopier(buffer_bytes=5000, write_behind=True) as copier:
            with pytest.raises(OSError):
                copier.copy(src.fileno(), 0, 100_000, read_only, 0, lambda piece: None)
                copier.finish()
    finally:
        os.close(read_only)
        os.unlink(target)


def _loaded_checksum(d: Daemon, request: Acquire) -> tuple[str, int]:
    with DaemonClient(d.runtime_dir, timeout=30) as client:
        result = client.acquire(request)
        assert result.state == "ready"
        (seg,) = [s for s in client.status()["segments"] if s["name"] == result.name]
    return seg["checksum"], seg["load_parts"]


@pytest.mark.parametrize("processes", ["1", "2"])
def test_loads_record_the_crc_of_their_rows(work: Path, processes: str) -> None:
    d = Daemon("--load-processes", processes)
    d.env["H5SERVE_MIN_PART_BYTES"] = "16384"  # split even these small shards
    try:
        d.start()
        with h5py.File(work / "plain.h5", "r") as f:
            holes = f["holes"][:]
        checksum, parts = _loaded_checksum(d, Acquire(str(work / "plain.h5"), "holes", 1, 0))
        assert checksum == expected_checksum(holes.tobytes()) and parts == int(processes)
        checksum, _ = _loaded_checksum(d, Acquire(str(work / "plain.h5"), "holes", 3, 1, "interleave"))
        assert checksum == expected_checksum(holes[1::3].tobytes())
        files = tuple(str(work / f"part{i}.h5") for i in range(2))
        rows = []
        for name in files:
            with h5py.File(name, "r") as f:
                rows.append(f["x"][:])
        checksum, parts = _loaded_checksum(d, Acquire(files[0], "x", 1, 0, files=files))
        assert checksum == expected_checksum(np.concatenate(rows).tobytes())
    finally:
        d.stop()
