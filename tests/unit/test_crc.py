"""Checksum kinds (h5serve/util/crc.py): known check values, joining parts, and segments that
record either kind verify with the kind they record."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np
import pytest

from h5serve.segments import create_segment, segment_name, temporary_name, verify_content
from h5serve.util.crc import CRC32, CRC32C, KINDS, LOAD_CRC, CrcKind

from ..helpers import NAMESPACE, SECRET, make_meta, sample_data

pytestmark = pytest.mark.timeout(60)
ALL_KINDS = [kind for kind in (CRC32, CRC32C) if kind is not None]


def test_check_values() -> None:
    # the catalogue check values of CRC-32 (ISO-HDLC) and CRC-32C (iSCSI)
    assert CRC32.update(b"123456789", 0) == 0xCBF43926
    if CRC32C is None:
        pytest.skip("the crc32c package is not installed: loads record crc32")
    assert CRC32C.update(b"123456789", 0) == 0xE3069283


@pytest.mark.parametrize("kind", ALL_KINDS, ids=lambda k: k.name)
def test_combine_joins_parts_at_any_cut(kind: CrcKind) -> None:
    data = np.random.default_rng(0).integers(0, 256, 300_007, dtype=np.uint8)
    whole = kind.update(data, 0)
    for cut in (0, 1, 7, 4096, 65_536, 300_006, 300_007):
        assert kind.combine(kind.update(data[:cut], 0), kind.update(data[cut:], 0), len(data) - cut) == whole
    assert kind.update(data[100:], kind.update(data[:100], 0)) == whole  # incremental, as loads hash


def test_loads_record_the_hardware_kind_when_there_is_one() -> None:
    crc32c = pytest.importorskip("crc32c", reason="the crc32c package is not installed: loads record crc32")
    assert LOAD_CRC is (CRC32C if crc32c.hardware_based else CRC32)
    assert KINDS[LOAD_CRC.code] is LOAD_CRC


@pytest.mark.parametrize("kind", ALL_KINDS, ids=lambda k: k.name)
def test_a_segment_verifies_with_the_kind_it_records(tmp_path: Path, kind: CrcKind) -> None:
    """A segment published by an h5serve that recorded crc32 (before crc32c) still verifies,
    and a changed byte is named with the recorded kind."""
    meta = make_meta()
    name = segment_name(NAMESPACE, meta, SECRET)
    writer = create_segment(tmp_path, temporary_name(name), meta)
    data = sample_data(meta)
    writer.data[...] = data
    recorded = writer.store_checksum(kind.update(data.tobytes(), 0), kind)
    assert recorded == f"{kind.name}:{zlib.crc32(data.tobytes()) if kind is CRC32 else kind.update(data, 0):08x}"
    path = writer.publish(name)
    assert verify_content(path, recorded) == ""
    os.chmod(path, 0o600)
    with open(path, "r+b") as f:
        f.seek(meta.header_size + 5)
        byte = f.read(1)
        f.seek(meta.header_size + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    problem = verify_content(path, recorded)
    assert problem.startswith(f"its rows have checksum {kind.name}:") and f"not the {recorded}" in problem
