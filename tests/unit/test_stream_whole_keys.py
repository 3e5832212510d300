"""Which keys a daemon-served stream holds whole (``stream.whole_keys``): small fixed-length keys
of one file (labels), together at most 1/WHOLE_KEY_SHARE of the budget, never the largest key,
never variable-length rows, never many files; every rank decides alike from the budget; the
window a daemon of a budget takes (automatic stream mode and ``h5serve inspect``) is what is left
beside them."""

from __future__ import annotations

import numpy as np
import pytest

from h5serve.client.streaming.backend import key_shape, whole_cost, whole_keys
from h5serve.hdf5.source import DatasetInfo
from h5serve.order.stream_plan import WHOLE_KEY_SHARE, daemon_window, plan_window, recommend
from h5serve.segments import HEADER_SIZE
from h5serve.util.units import allocated_bytes

pytestmark = pytest.mark.timeout(30)

ROWS = 100_000


def _info(key: str, row_shape: tuple[int, ...], dtype: str, vlen: str = "") -> DatasetInfo:
    return DatasetInfo(key=key, rows=ROWS, row_shape=row_shape, dtype=np.dtype(dtype), chunk_rows=256,
                       vlen=vlen, mean_length=10.0 if vlen else 0.0)


IMAGES, LABELS, WEIGHTS = _info("x", (3, 32, 32), "uint8"), _info("y", (), "int64"), _info("w", (), "float32")


def test_labels_are_held_whole_when_they_take_a_sixteenth_of_the_budget_or_less() -> None:
    need = allocated_bytes(ROWS * 8 + HEADER_SIZE)  # one segment, in whole pages
    assert whole_keys([IMAGES, LABELS], need * WHOLE_KEY_SHARE, False) == [False, True]
    assert whole_keys([IMAGES, LABELS], need * WHOLE_KEY_SHARE - 1, False) == [False, False]
    assert whole_cost([IMAGES, LABELS], [False, True]) == need


def test_small_keys_together_stay_within_the_share_smallest_first() -> None:
    labels, weights = allocated_bytes(ROWS * 8 + HEADER_SIZE), allocated_bytes(ROWS * 4 + HEADER_SIZE)
    budget = (labels + weights) * WHOLE_KEY_SHARE
    assert whole_keys([IMAGES, LABELS, WEIGHTS], budget, False) == [False, True, True]
    assert whole_keys([IMAGES, LABELS, WEIGHTS], budget - WHOLE_KEY_SHARE, False) == [False, False, True]


def test_the_largest_key_variable_length_rows_and_many_files_are_always_streamed() -> None:
    huge = 1 << 50
    assert whole_keys([IMAGES, LABELS], huge, False) == [False, True]  # x streams, however large the budget
    assert whole_keys([LABELS], huge, False) == [False]
    assert whole_keys([IMAGES, _info("t", (), "float64", vlen="seq")], huge, False) == [False, False]
    assert whole_keys([IMAGES, LABELS], huge, True) == [False, False]


def test_the_daemon_window_is_what_the_labels_held_whole_leave() -> None:
    keys = [key_shape(IMAGES), key_shape(LABELS)]
    limit = 40 * 1024 * 1024
    got = daemon_window(keys, limit)
    assert got is not None and got.whole == (False, True) and got.whole_bytes == allocated_bytes(ROWS * 8 + HEADER_SIZE)
    alone = plan_window([256, 256], [3072, 8], ROWS, limit - got.whole_bytes)
    assert alone is not None and (got.block_rows, got.capacity, got.window) == (
        alone.block_rows, alone.capacity, alone.window)
    assert got.capacity * got.block_cost + got.whole_bytes <= limit
    everything = plan_window([256, 256], [3072, 8], ROWS, limit)
    assert everything is not None and everything.window >= got.window  # the labels' room came out of the window
    mode, recommended = recommend({"global": 1 << 40}, None, False, limit, keys)
    assert mode == "stream" and recommended == got
    small = daemon_window(keys, allocated_bytes(ROWS * 8 + HEADER_SIZE) * WHOLE_KEY_SHARE - 1)
    assert small is not None and small.whole == (False, False) and small.whole_bytes == 0
