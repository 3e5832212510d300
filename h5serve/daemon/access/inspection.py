"""What an inspector child answers, as bytes the daemon decodes strictly.

The inspector (inspector.py) runs as the requesting user in a root daemon: whatever that
child writes may have been written by the user (a bug in HDF5 reached through a crafted
file, or a process that got hold of the child's pipe). So its answer is data, never code:
msgpack with a fixed schema, every field's type and range checked, sizes bounded, decoded
into the same frozen records the resolver uses. Never pickle: unpickling runs code.

Pure functions of bytes: no process, no HDF5 (tests/unit/test_inspection.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from ...errors import ERROR_CODES, SourceChanged
from ...hdf5.identity import FileIdentity
from ...hdf5.source import SOURCE_KINDS, DatasetInfo
from ...hdf5.vlen import VLEN_KINDS
from ...wire.protocol import MAX_FILES, MAX_KEY_CHARS, MAX_PATH_CHARS

__all__ = ["Inspection", "InspectionFailed", "VirtualFound", "Answer", "encode_answer", "decode_answer",
           "MAX_ANSWER_BYTES"]

MAX_ANSWER_BYTES = 1 << 20  # a dataset's description with MAX_FILES virtual sources fits well within
_MAX_MESSAGE_CHARS = 4096
_MAX_DIMS = 32
_MAX_INT = (1 << 63) - 1
_MAX_DTYPE_CHARS = 16


@dataclass(frozen=True)
class Inspection:
    """What the child found: the dataset's description, the identity of the file an
    external link led HDF5 to (None: the rows are in the file itself), and whether it is a
    virtual dataset (its sources are opened by name when read: they cannot be pinned)."""

    info: DatasetInfo
    linked: FileIdentity | None
    virtual: bool


@dataclass(frozen=True)
class InspectionFailed:
    """The inspection raised: the error's wire code and message (errors.ERROR_CODES)."""

    code: str
    message: str


@dataclass(frozen=True)
class VirtualFound:
    """The key names a virtual dataset, and the requester may not have one loaded."""


Answer = Inspection | InspectionFailed | VirtualFound


def _identity(ident: FileIdentity) -> list[Any]:
    return [ident.path, ident.dev, ident.ino, ident.size, ident.mtime_ns, ident.ctime_ns]


def encode_answer(answer: Answer) -> bytes:
    """The bytes an inspector writes for ``answer``."""
    if isinstance(answer, VirtualFound):
        return msgpack.packb({"kind": "virtual"})
    if isinstance(answer, InspectionFailed):
        return msgpack.packb({"kind": "failed", "code": answer.code, "message": answer.message[:_MAX_MESSAGE_CHARS]})
    info = answer.info
    return msgpack.packb({
        "kind": "inspection",
        "info": {"key": info.key, "rows": info.rows, "row_shape": list(info.row_shape), "dtype": info.dtype.str,
                 "chunk_rows": info.chunk_rows, "linked_file": info.linked_file, "chunked": info.chunked,
                 "field": info.field, "virtual_sources": list(info.virtual_sources), "vlen": info.vlen,
                 "mean_length": float(info.mean_length)},
        "linked": None if answer.linked is None else _identity(answer.linked),
        "virtual": answer.virtual,
    })


class _Bad(Exception):
    pass


def _fields(data: object, names: set[str]) -> dict[str, Any]:
    if not isinstance(data, dict) or set(data) != names:
        raise _Bad(f"expected the fields {sorted(names)}")
    return data


def _int(value: object, what: str) -> int:
    if type(value) is not int or not 0 <= value <= _MAX_INT:
        raise _Bad(f"{what} is not a count")
    return value


def _str(value: object, what: str, limit: int, empty_ok: bool = True) -> str:
    if type(value) is not str or len(value) > limit or (not value and not empty_ok) or "\0" in value:
        raise _Bad(f"{what} is not a string of at most {limit} characters")
    return value


def _path(value: object, what: str, empty_ok: bool = False) -> str:
    path = _str(value, what, MAX_PATH_CHARS, empty_ok)
    if path and not path.startswith("/"):
        raise _Bad(f"{what} is not an absolute path")
    return path


def _dtype(value: object) -> np.dtype:
    text = _str(value, "dtype", _MAX_DTYPE_CHARS, empty_ok=False)
    if not all(c.isalnum() or c in "<>|=" for c in text):
        raise _Bad("dtype is not a plain dtype string")
    try:
        dtype = np.dtype(text)
    except TypeError as exc:
        raise _Bad("dtype is not a numpy dtype") from exc
    if dtype.kind not in SOURCE_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise _Bad(f"dtype {dtype} cannot be served")
    return dtype


def _info(data: object, key: str) -> DatasetInfo:
    d = _fields(data, {"key", "rows", "row_shape", "dtype", "chunk_rows", "linked_file", "chunked", "field",
                       "virtual_sources", "vlen", "mean_length"})
    if d["key"] != key:
        raise _Bad("the key is not the one asked for")
    shape = d["row_shape"]
    if not isinstance(shape, list) or len(shape) > _MAX_DIMS:
        raise _Bad("row_shape is not a list of dimensions")
    sources = d["virtual_sources"]
    if not isinstance(sources, list) or len(sources) > MAX_FILES:
        raise _Bad("virtual_sources is not a list of files")
    if type(d["chunked"]) is not bool or d["vlen"] not in VLEN_KINDS or (d["vlen"] and shape):
        raise _Bad("chunked or vlen is invalid")
    mean = d["mean_length"]
    if type(mean) is not float or not math.isfinite(mean) or mean < 0:
        raise _Bad("mean_length is not a length")
    return DatasetInfo(key=key, rows=_int(d["rows"], "rows"),
                       row_shape=tuple(_int(n, "a row dimension") for n in shape), dtype=_dtype(d["dtype"]),
                       chunk_rows=_int(d["chunk_rows"], "chunk_rows"),
                       linked_file=_path(d["linked_file"], "linked_file", empty_ok=True),
                       chunked=d["chunked"], field=_str(d["field"], "field", MAX_KEY_CHARS),
                       virtual_sources=tuple(_path(p, "a virtual source") for p in sources),
                       vlen=d["vlen"], mean_length=mean)


def _linked(data: object) -> FileIdentity | None:
    if data is None:
        return None
    if not isinstance(data, list) or len(data) != 6:
        raise _Bad("linked is not a file identity")
    path = _path(data[0], "linked's path")
    dev, ino, size, mtime_ns, ctime_ns = (_int(v, "a linked identity's number") for v in data[1:])
    return FileIdentity(path, dev, ino, size, mtime_ns, ctime_ns)


def decode_answer(blob: bytes, key: str) -> Answer:
    """The answer an inspector of ``key`` wrote, checked field by field.

    Raised when it is not exactly an answer of the schema (too large, malformed, a field out
    of range, another key): SourceChanged saying the inspection's answer was refused.
    """
    try:
        if len(blob) > MAX_ANSWER_BYTES:
            raise _Bad(f"{len(blob)} bytes")
        try:
            data = msgpack.unpackb(blob, raw=False, strict_map_key=True, max_str_len=MAX_ANSWER_BYTES, max_bin_len=0,
                                   max_ext_len=0, max_array_len=MAX_ANSWER_BYTES, max_map_len=64)
        except Exception as exc:  # msgpack raises several unrelated types for bad input  # noqa: BLE001
            raise _Bad(f"not msgpack: {type(exc).__name__}") from exc
        if not isinstance(data, dict):
            raise _Bad("not a map")
        kind = data.get("kind")
        if kind == "virtual":
            _fields(data, {"kind"})
            return VirtualFound()
        if kind == "failed":
            d = _fields(data, {"kind", "code", "message"})
            code = _str(d["code"], "code", 64, empty_ok=False)
            if code not in ERROR_CODES:
                raise _Bad("an unknown error code")
            return InspectionFailed(code, _str(d["message"], "message", _MAX_MESSAGE_CHARS))
        if kind == "inspection":
            d = _fields(data, {"kind", "info", "linked", "virtual"})
            if type(d["virtual"]) is not bool:
                raise _Bad("virtual is not a bool")
            return Inspection(_info(d["info"], key), _linked(d["linked"]), d["virtual"])
        raise _Bad("an unknown kind")
    except _Bad as exc:
        raise SourceChanged(
            f"the process that read {key!r}'s metadata answered something that is not a description of it "
            f"({exc}); the request is refused: check the file, or ask again") from exc
