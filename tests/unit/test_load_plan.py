"""The daemon plans a load's parts from the metadata it already holds (``load_spans``), so the
loader opens nothing before it forks: the same parts the loader plans itself (``plan_parts``),
and one part where the loader would not split."""

from __future__ import annotations

import numpy as np
import pytest

from h5serve.daemon.loading.loader import MIN_PART_BYTES, load_spans, plan_parts
from h5serve.hdf5.source import DatasetInfo
from h5serve.order.sharding import Selection

from ..helpers import make_meta

ROW_SHAPE = (1024, 1024)  # 1 MiB rows


def info(rows: int, chunk_rows: int = 10) -> DatasetInfo:
    return DatasetInfo(key="x", rows=rows, row_shape=ROW_SHAPE, dtype=np.dtype("uint8"), chunk_rows=chunk_rows)


@pytest.mark.parametrize(("total", "world", "rank", "mode"), [(200, 1, 0, "contiguous"), (300, 2, 1, "contiguous"),
                                                          (300, 3, 2, "interleave"), (1000, 4, 0, "contiguous")])
@pytest.mark.parametrize("processes", [2, 3, 8])
def test_the_daemon_plans_the_parts_the_loader_would(total: int, world: int, rank: int, mode: str,
                                                     processes: int) -> None:
    rows = Selection(mode, world, rank).count(total)
    meta = make_meta(rows=rows, row_shape=ROW_SHAPE, dtype="uint8", total_rows=total, world_size=world, rank=rank,
                     mode=mode)
    planned = load_spans(info(total), meta, processes)
    assert list(planned) == plan_parts(info(total), meta.row_range, processes)
    assert len(planned) > 1


def test_one_part_where_the_loader_would_not_split() -> None:
    small_rows = 2 * MIN_PART_BYTES // 2**20 - 1  # under two minimum parts of 1 MiB rows
    small = make_meta(rows=small_rows, row_shape=ROW_SHAPE, dtype="uint8", total_rows=small_rows, world_size=1,
                      rank=0)
    assert load_spans(info(small_rows), small, 8) == ((0, small_rows),)
    big = make_meta(rows=200, row_shape=ROW_SHAPE, dtype="uint8", total_rows=200, world_size=1, rank=0)
    assert load_spans(info(200), big, 1) == ((0, 200),)  # one process allowed
    vlen = make_meta(rows=200, row_shape=(), dtype="uint8", total_rows=200, world_size=1, rank=0, vlen="seq",
                     values=10**9)
    assert load_spans(info(200), vlen, 8) == ((0, 200),)  # variable-length rows load in one process
