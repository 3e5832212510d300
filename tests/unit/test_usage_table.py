"""docs/usage.md's argument table of ``SharedH5Dataset`` against its signature: every parameter has
a row, and no row names a parameter that does not exist, so the table cannot drift from the code."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from h5serve.client import SharedH5Dataset
from h5serve.client.streaming.daemon_blocks import DEFAULT_WAIT_S
from h5serve.order.sharding import ALL_MODES, STREAM
from h5serve.wire.connection import DEFAULT_TIMEOUT_S

USAGE = Path(__file__).resolve().parents[2] / "docs" / "usage.md"
HEADER = "| argument | meaning |"


def table_rows() -> list[str]:
    """The first cells of the argument table: from its header to the first line that is not a row."""
    lines = USAGE.read_text().splitlines()
    start = lines.index(HEADER)
    rows: list[str] = []
    for line in lines[start + 2:]:  # past the header and its |---|---| line
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1])
    return rows


def documented() -> list[str]:
    return [name for cell in table_rows() for name in re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", cell)]


def test_every_parameter_of_the_dataset_has_a_row_and_every_row_a_parameter() -> None:
    params = [p for p in inspect.signature(SharedH5Dataset.__init__).parameters if p != "self"]
    names = documented()
    assert sorted(set(params) - set(names)) == [], "parameters without a row in docs/usage.md's argument table"
    assert sorted(set(names) - set(params)) == [], "rows of docs/usage.md's argument table naming no parameter"
    assert len(names) == len(set(names)), "a parameter with two rows"


def test_the_table_is_one_table() -> None:
    """A blank line inside the table ends it in Markdown: the rows after it are not in the table."""
    lines = USAGE.read_text().splitlines()
    after = lines[lines.index(HEADER) + 2 + len(table_rows()):]
    assert not any(line.startswith("| `") for line in after[:3])


def test_the_mode_row_names_every_mode_and_the_timeout_row_the_defaults_in_the_code() -> None:
    lines = USAGE.read_text().splitlines()
    mode = next(line for line in lines if line.startswith("| `mode` |"))
    for name in (*ALL_MODES, STREAM):
        assert f'`"{name}"`' in mode, name
    timeout = next(line for line in lines if line.startswith("| `timeout` |"))
    # a request's default deadline, and how long a stream block waits for room by default
    assert f"{DEFAULT_TIMEOUT_S:g} s" in timeout and f"room for {DEFAULT_WAIT_S:g} s" in timeout
