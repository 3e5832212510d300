"""An inspector's answer is data decoded with a schema, never code (security round three,
finding 2): what a requester's process writes can at most be refused."""

from __future__ import annotations

import os
import pickle

import msgpack
import numpy as np
import pytest

from h5serve.daemon.access.inspection import (
    MAX_ANSWER_BYTES,
    Inspection,
    InspectionFailed,
    VirtualFound,
    decode_answer,
    encode_answer,
)
from h5serve.errors import SourceChanged
from h5serve.hdf5.identity import FileIdentity
from h5serve.hdf5.source import DatasetInfo

INFO = DatasetInfo("x", 1000, (3, 4), np.dtype("<f4"), 64, linked_file="/data/other.h5", field="",
                   virtual_sources=("/data/a.h5",), vlen="", mean_length=0.0)
LINKED = FileIdentity("/data/other.h5", 2049, 77, 4096, 1_700_000_000_000_000_000, 1_700_000_000_000_000_001)


def _wire(answer: dict[str, object]) -> bytes:
    return msgpack.packb(answer)


def _good() -> dict[str, object]:
    return msgpack.unpackb(encode_answer(Inspection(INFO, LINKED, False)))


@pytest.mark.parametrize("answer", [
    Inspection(INFO, LINKED, False),
    Inspection(DatasetInfo("events", 7, (), np.dtype("uint8"), 7, chunked=False, vlen="utf-8", mean_length=3.5),
               None, True),
    InspectionFailed("key_not_found", "no dataset 'x'"),
    VirtualFound(),
])
def test_every_answer_survives_the_trip(answer: object) -> None:
    key = answer.info.key if isinstance(answer, Inspection) else "x"
    assert decode_answer(encode_answer(answer), key) == answer  # type: ignore[arg-type]


def test_a_pickle_is_refused_and_never_run(tmp_path: os.PathLike[str]) -> None:
    """The round-three exploit wrote a pickle whose loading ran os.system: now it is refused."""
    marker = os.path.join(str(tmp_path), "ran")

    class Exploit:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    with pytest.raises(SourceChanged, match="not a description"):
        decode_answer(pickle.dumps(Exploit()), "x")
    assert not os.path.exists(marker)


@pytest.mark.parametrize("change", [
    lambda a: a.update(extra=1),
    lambda a: a.update(kind="other"),
    lambda a: a["info"].update(key="y"),  # another key than the one asked for
    lambda a: a["info"].update(rows=-1),
    lambda a: a["info"].update(rows=(1 << 64) - 1),  # over int64
    lambda a: a["info"].update(rows=True),
    lambda a: a["info"].update(dtype="O"),
    lambda a: a["info"].update(dtype="[('a', '<f4')]"),
    lambda a: a["info"].update(dtype="V8"),
    lambda a: a["info"].update(row_shape=[1] * 33),
    lambda a: a["info"].update(linked_file="relative.h5"),
    lambda a: a["info"].update(virtual_sources=["/a\x00b"]),
    lambda a: a["info"].update(vlen="latin-1"),
    lambda a: a["info"].update(mean_length=float("nan")),
    lambda a: a.update(linked=["/x", 1, 2, 3]),
    lambda a: a.update(linked=["/x", 1, 2, 3, 4, -5]),
    lambda a: a.update(virtual=1),
    lambda a: a["info"].pop("chunked"),
])
def test_an_answer_off_the_schema_is_refused(change: object) -> None:
    answer = _good()
    change(answer)  # type: ignore[operator]
    with pytest.raises(SourceChanged, match="not a description"):
        decode_answer(_wire(answer), "x")


def test_failures_name_only_known_errors_and_bounded_messages() -> None:
    with pytest.raises(SourceChanged):
        decode_answer(_wire({"kind": "failed", "code": "no_such_code", "message": "m"}), "x")
    with pytest.raises(SourceChanged):
        decode_answer(_wire({"kind": "failed", "code": "key_not_found", "message": "m" * 5000}), "x")
    long = encode_answer(InspectionFailed("key_not_found", "m" * 10_000))
    assert decode_answer(long, "x") == InspectionFailed("key_not_found", "m" * 4096)


def test_oversized_or_malformed_bytes_are_refused() -> None:
    for blob in (b"", b"\xc1", b"\x92\x01", bytes(MAX_ANSWER_BYTES + 1), msgpack.packb([1, 2])):
        with pytest.raises(SourceChanged):
            decode_answer(blob, "x")
