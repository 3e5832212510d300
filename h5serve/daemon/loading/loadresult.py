"""What a loader reports to the daemon (loader.py and remoteload.py send one of these over
its pipe; the store's reaper reads it)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LoadStats", "LoadOk", "LoadError"]


@dataclass(frozen=True)
class LoadStats:
    """How a load went, for the daemon's log and metrics."""

    parts: int  # processes the rows were read by
    create_s: float  # creating (and reserving) the segment
    copied_bytes: int  # bytes copied file to file instead of through h5py
    read_s: float  # reading every row, all parts, from when the segment was reserved
    part_s: tuple[float, ...]  # when each part was done, from the start of the reads
    checksum: str  # "crc32c:..." as stored in the header, "" when not computed
    checksum_s: float
    page_cache_drop_bytes: int  # source bytes whose cached pages are dropped after publishing
    values: int  # variable-length rows: the values written (the segment's size depends on it)
    fetched_bytes: int = 0  # an object of a store: bytes its GETs received (metadata included)
    fetch_s: float = 0.0  # ... and the seconds spent fetching them


@dataclass(frozen=True)
class LoadOk:
    """A loader's reply: the segment is published, as ``name`` (the job's final name, or a
    fresh one when a file that is not ours held that: lifecycle.publish)."""

    stats: LoadStats
    name: str = ""


@dataclass(frozen=True)
class LoadError:
    """A loader's reply: the load failed (``code`` as in h5serve.errors) and the temporary is gone."""

    code: str
    message: str
