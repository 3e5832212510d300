"""The report ``h5serve inspect`` builds (cli/inspect.py) and renders (cli/inspect_text.py):
frozen dataclasses, and ``InspectReport.to_dict``, the ``--json`` output."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..order.stream_plan import StreamWindow

__all__ = ["SCHEMA_VERSION", "Advice", "DaemonReport", "DatasetReport", "FilterReport", "InspectReport", "ModeNeed",
           "ShmReport", "held_keys"]

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class FilterReport:
    id: int
    name: str
    available: bool  # HDF5 can run it in this process (built in, or its plugin is here)
    compression: bool  # decoding it costs CPU per chunk


@dataclass(frozen=True)
class DatasetReport:
    key: str
    rows: int
    row_shape: tuple[int, ...]
    dtype: str
    nbytes: int
    layout: str  # "chunked", "contiguous", "compact" or "virtual"
    chunk_rows: int | None  # rows per chunk (None: not chunked)
    chunk_bytes: int | None
    filters: tuple[FilterReport, ...]
    problem: str  # why h5serve cannot serve it as it is ("" when it can)
    vlen: bool = False  # variable-length rows (row_bytes: an int64 offset and the mean of the first rows)

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.rows if self.rows else 0

    @property
    def counted(self) -> bool:
        """Counted in the memory needs: servable, or servable once its filter plugin is installed."""
        return not self.problem or any(not f.available for f in self.filters)


@dataclass(frozen=True)
class ModeNeed:
    mode: str
    rows: int  # rows (samples) this node holds: of the longest counted dataset, never summed across datasets
    bytes: int  # shared memory on this node, segment headers included
    fits: bool  # within the budget


@dataclass(frozen=True)
class ShmReport:
    path: str
    size: int
    free: int
    notes: tuple[str, ...]  # "docker-64m", "slurm-job-tmpfs"


@dataclass(frozen=True)
class DaemonReport:
    runtime_dir: str
    running: bool
    pid: int | None = None
    shm_dir: str | None = None
    budget: int | None = None
    used: int | None = None
    shm_visible: bool | None = None  # None: running, but it cannot be told from here
    how: str = ""  # how visibility was decided, or why there is no daemon


@dataclass(frozen=True)
class Advice:
    code: str  # one_row_chunks, compressed, over_budget, missing_filter, unservable, docker_shm, slurm_tmpfs,
    #            shm_not_shared, low_nofile
    key: str | None  # the dataset it is about (None: the node)
    text: str


@dataclass(frozen=True)
class InspectReport:
    file: str
    file_bytes: int
    world_size: int
    ranks_per_node: int
    mode: str | None  # the mode asked about (None: every mode but stream)
    datasets: tuple[DatasetReport, ...]
    needs: tuple[ModeNeed, ...]
    budget: int
    budget_rule: str
    shm: ShmReport
    daemon: DaemonReport
    nofile_soft: int
    nofile_hard: int
    recommended_mode: str  # the mode asked about (else global, or node) when it fits, else "stream"
    stream: StreamWindow | None  # "stream": its window, what min(budget, shm size) holds, and block
    advice: tuple[Advice, ...]
    remote: str = ""  # a remote file (s3://, https://): its object's identity (size, ETag, version); "" when local

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for d, src in zip(out["datasets"], self.datasets):
            d["row_bytes"] = src.row_bytes
        return {"schema_version": SCHEMA_VERSION, **out}


def held_keys(datasets: tuple[DatasetReport, ...], window: StreamWindow) -> list[str]:
    """The keys ``window`` holds whole (its ``whole`` is per counted dataset, in order)."""
    return [d.key for d, whole in zip([d for d in datasets if d.counted], window.whole) if whole]
