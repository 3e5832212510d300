"""Unit tests for h5serve.wire.protocol: encoding, strict decoding, error replies."""

import dataclasses

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from h5serve import errors
from h5serve.errors import ERROR_CODES, H5ServeError, ProtocolError, RemoteError
from h5serve.order.sharding import MODES
from h5serve.wire.protocol import (
    MAX_DTYPE_CHARS,
    MAX_FRAME_BYTES,
    MAX_KEY_CHARS,
    MAX_PATH_CHARS,
    MAX_REPLY_BYTES,
    MAX_WORLD_SIZE,
    VERSION,
    Acquire,
    AcquireResult,
    Ping,
    Shutdown,
    Status,
    decode_reply,
    decode_request,
    encode_error,
    encode_ok,
    encode_request,
)

VALID_ACQUIRE = {
    "v": VERSION,
    "id": 1,
    "op": "acquire",
    "path": "/data/train.h5",
    "key": "x",
    "world_size": 4,
    "rank": 3,
    "mode": "interleave",
    "dtype": "float32",
}


def pack(obj):
    return msgpack.packb(obj, use_bin_type=True)


def acquire_frame(**changes):
    """A packed acquire request; ``changes`` with value ``...`` delete that field."""
    message = dict(VALID_ACQUIRE)
    for name, value in changes.items():
        if value is ...:
            message.pop(name, None)
        else:
            message[name] = value
    return pack(message)


def assert_rejected(frame, decode=decode_request):
    """The frame is refused with ProtocolError; any other exception propagates and fails."""
    with pytest.raises(ProtocolError):
        decode(frame)


# --------------------------------------------------------------------------- round trips

REQUESTS = [
    Ping(),
    Status(),
    Shutdown(),
    Acquire(path="/data/train.h5", key="x", world_size=1, rank=0),
    Acquire(path="/data/train.h5", key="grp/y", world_size=8, rank=7, mode="interleave", dtype="uint8"),
    Acquire(path="/data/file.h5", key="x", world_size=2, rank=1, mode="contiguous", dtype=None),
    Acquire(path="/ü/ñ.h5", key="日本", world_size=MAX_WORLD_SIZE, rank=MAX_WORLD_SIZE - 1),
    Acquire(path="/" + "p" * (MAX_PATH_CHARS - 1), key="k" * MAX_KEY_CHARS, world_size=3, rank=2,
            dtype="d" * MAX_DTYPE_CHARS),
]


@pytest.mark.parametrize("request_obj", REQUESTS, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("request_id", [0, 1, 12345, 2**63 - 1])
def test_request_round_trip(request_obj, request_id):
    frame = encode_request(request_id, request_obj)
    assert isinstance(frame, bytes)
    got_id, got = decode_request(frame)
    assert got_id == request_id
    assert type(got) is type(request_obj)
    assert got == request_obj


def test_every_request_type_round_trips_with_its_op():
    seen = set()
    for req in REQUESTS:
        message = msgpack.unpackb(encode_request(5, req), raw=False)
        assert message["v"] == VERSION
        assert message["id"] == 5
        assert message["op"] == type(req).OP
        seen.add(message["op"])
    assert seen == {"ping", "status", "shutdown", "acquire"}


def test_acquire_defaults_survive_round_trip():
    _id, got = decode_request(pack({"v": VERSION, "id": 3, "op": "acquire", "path": "/a.h5", "key": "x",
                                    "world_size": 2, "rank": 1}))
    assert got == Acquire(path="/a.h5", key="x", world_size=2, rank=1, mode="contiguous", dtype=None)


@pytest.mark.parametrize("frame_type", [bytearray, memoryview])
def test_decode_request_accepts_bytes_like(frame_type):
    frame = encode_request(9, Ping())
    assert decode_request(frame_type(frame)) == (9, Ping())


@pytest.mark.parametrize("mode", MODES)
def test_acquire_accepts_every_mode(mode):
    req = Acquire(path="/a.h5", key="x", world_size=2, rank=0, mode=mode)
    assert decode_request(encode_request(1, req))[1].mode == mode


# --------------------------------------------------------------------------- replies


def test_ok_reply_round_trip():
    result = {"pid": 123, "version": "0.1.0", "nested": {"a": [1, 2, 3], "b": None}, "f": 1.5, "s": "ü"}
    frame = encode_ok(42, result)
    got_id, got = decode_reply(frame)
    assert got_id == 42
    assert got == result


def test_ok_reply_with_empty_result():
    assert decode_reply(encode_ok(0, {})) == (0, {})


@pytest.mark.parametrize("code", sorted(ERROR_CODES))
def test_error_reply_gives_class_named_by_code(code):
    got_id, err = decode_reply(encode_error(17, code, f"something about {code}"))
    assert got_id == 17
    assert type(err) is ERROR_CODES[code]
    assert isinstance(err, H5ServeError)
    assert str(err) == f"something about {code}"
    assert err.code == code


def test_error_codes_cover_every_error_class():
    classes = {obj for obj in vars(errors).values() if isinstance(obj, type) and issubclass(obj, H5ServeError)}
    assert set(ERROR_CODES.values()) == classes
    assert all(ERROR_CODES[cls.code] is cls for cls in classes)


def test_unknown_error_code_is_remote_error():
    got_id, err = decode_reply(encode_error(3, "no_such_code", "boom"))
    assert got_id == 3
    assert type(err) is RemoteError
    assert str(err) == "boom"


def test_error_reply_message_is_coerced_to_str():
    got_id, err = decode_reply(pack({"v": VERSION, "id": 2, "ok": False, "code": "segment", "message": 5}))
    assert type(err) is errors.SegmentError and str(err) == "5"
    got_id, err = decode_reply(pack({"v": VERSION, "id": 2, "ok": False, "code": "segment"}))
    assert type(err) is errors.SegmentError and str(err) == ""


def test_reply_may_exceed_request_limit():
    big = "x" * (MAX_FRAME_BYTES * 4)
    frame = encode_ok(1, {"blob": big})
    assert len(frame) > MAX_FRAME_BYTES
    assert decode_reply(frame) == (1, {"blob": big})


def test_reply_larger_than_reply_limit_is_rejected():
    frame = encode_ok(1, {"blob": "x" * (MAX_REPLY_BYTES + 1)})
    with pytest.raises(ProtocolError, match="at most"):
        decode_reply(frame)


@pytest.mark.parametrize(
    "message",
    [
        {"v": VERSION, "id": 1},  # neither ok nor error
        {"v": VERSION, "id": 1, "ok": True},  # no result
        {"v": VERSION, "id": 1, "ok": True, "result": [1, 2]},  # result not a map
        {"v": VERSION, "id": 1, "ok": True, "result": None},
        {"v": VERSION, "id": 1, "ok": 1, "result": {}},  # ok must be a bool
        {"v": VERSION, "id": 1, "ok": False},  # error without code
        {"v": VERSION, "id": 1, "ok": False, "code": 7, "message": "x"},  # code not a str
        {"v": VERSION, "ok": True, "result": {}},  # no id
        {"v": VERSION, "id": -1, "ok": True, "result": {}},
        {"v": VERSION, "id": "1", "ok": True, "result": {}},
        {"v": VERSION + 1, "id": 1, "ok": True, "result": {}},
        {"id": 1, "ok": True, "result": {}},  # no version
        {"v": VERSION, "id": 1, "ok": True, "result": {"b": b"binary"}},  # bin is refused
        {"v": VERSION, "id": 1, "ok": True, "result": {"t": msgpack.ExtType(3, b"abc")}},
        [VERSION, 1, True, {}],  # not a map
        "ok",
    ],
)
def test_malformed_reply_is_protocol_error(message):
    assert_rejected(pack(message), decode=decode_reply)


@given(st.binary(max_size=512))
def test_random_bytes_reply_only_protocol_error(frame):
    try:
        got_id, got = decode_reply(frame)
    except ProtocolError:
        return
    # vanishingly unlikely, but if it decodes it must be well formed
    assert isinstance(got_id, int) and got_id >= 0
    assert isinstance(got, (dict, H5ServeError))


# --------------------------------------------------------------------------- malformed requests


@given(st.binary(max_size=512))
def test_random_bytes_request_only_protocol_error(frame):
    try:
        got_id, got = decode_request(frame)
    except ProtocolError:
        return
    assert isinstance(got_id, int)
    assert isinstance(got, (Ping, Status, Shutdown, Acquire))


@pytest.mark.parametrize("value", [[1, 2], "ping", 7, None, True, 1.5, b"\x01"])
def test_non_map_msgpack_is_rejected(value):
    with pytest.raises(ProtocolError, match="map|msgpack"):
        decode_request(pack(value))


@pytest.mark.parametrize("frame", ["a str", None, 123, [1], {"v": 1}])
def test_non_bytes_frame_is_rejected(frame):
    assert_rejected(frame)
    assert_rejected(frame, decode=decode_reply)


def test_empty_and_truncated_frames_are_rejected():
    assert_rejected(b"")
    full = encode_request(1, Acquire(path="/a.h5", key="x", world_size=2, rank=0))
    for cut in range(1, len(full)):
        assert_rejected(full[:cut])


def test_trailing_bytes_are_rejected():
    assert_rejected(encode_request(1, Ping()) + b"\x00")
    assert_rejected(encode_request(1, Ping()) * 2)


@pytest.mark.parametrize("version", [0, 2, VERSION + 1, -1, "1", None, [1]])
def test_wrong_version_is_rejected(version):
    with pytest.raises(ProtocolError, match="version"):
        decode_request(pack({"v": version, "id": 1, "op": "ping"}))


def test_missing_version_is_rejected():
    with pytest.raises(ProtocolError, match="version"):
        decode_request(pack({"id": 1, "op": "ping"}))


@pytest.mark.parametrize("version", [True, 1.0])
def test_version_must_be_an_int(version):
    # regression: 'version != VERSION' alone let True and 1.0 through as version 1
    assert_rejected(pack({"v": version, "id": 1, "op": "ping"}))


@pytest.mark.parametrize("request_id", [-1, 2**63, 2**64 - 1, "1", 1.0, True, None, [1]])
def test_bad_id_is_rejected(request_id):
    with pytest.raises(ProtocolError, match="id"):
        decode_request(pack({"v": VERSION, "id": request_id, "op": "ping"}))


def test_missing_id_is_rejected():
    with pytest.raises(ProtocolError, match="id"):
        decode_request(pack({"v": VERSION, "op": "ping"}))


def test_id_bounds_are_inclusive():
    assert decode_request(pack({"v": VERSION, "id": 0, "op": "ping"})) == (0, Ping())
    assert decode_request(pack({"v": VERSION, "id": 2**63 - 1, "op": "ping"})) == (2**63 - 1, Ping())


@pytest.mark.parametrize("op", ["pong", "", "PING", "Acquire", "__init__", None, 1, ["ping"], {"x": 1}])
def test_unknown_op_is_rejected(op):
    with pytest.raises(ProtocolError, match="op"):
        decode_request(pack({"v": VERSION, "id": 1, "op": op}))


def test_missing_op_is_rejected():
    with pytest.raises(ProtocolError, match="op"):
        decode_request(pack({"v": VERSION, "id": 1}))


@pytest.mark.parametrize("field", ["path", "key", "world_size", "rank"])
def test_acquire_missing_required_field_is_rejected(field):
    assert_rejected(acquire_frame(**{field: ...}))


@pytest.mark.parametrize("op", ["ping", "status", "shutdown"])
def test_extra_field_on_simple_ops_is_rejected(op):
    assert decode_request(pack({"v": VERSION, "id": 1, "op": op}))[0] == 1
    assert_rejected(pack({"v": VERSION, "id": 1, "op": op, "path": "/a.h5"}))
    assert_rejected(pack({"v": VERSION, "id": 1, "op": op, "self": 1}))


@pytest.mark.parametrize("extra", ["extra", "OP", "ok", "result", "self", "__class__"])
def test_acquire_extra_field_is_rejected(extra):
    assert_rejected(acquire_frame(**{extra: 1}))


def test_non_str_map_keys_are_rejected():
    message = dict(VALID_ACQUIRE)
    message[5] = "x"
    assert_rejected(pack(message))
    assert_rejected(pack({"v": VERSION, "id": 1, "op": "ping", b"": 1}))  # empty bin key
    assert_rejected(pack({"v": VERSION, "id": 1, "op": "ping", b"k": 1}))


@pytest.mark.parametrize(
    "field, value",
    [
        ("world_size", "4"),
        ("world_size", True),
        ("world_size", 4.0),
        ("world_size", 0),
        ("world_size", -4),
        ("world_size", MAX_WORLD_SIZE + 1),
        ("world_size", 2**64 - 1),
        ("world_size", None),
        ("world_size", [4]),
        ("rank", 4),  # == world_size
        ("rank", 5),
        ("rank", -1),
        ("rank", "3"),
        ("rank", False),
        ("rank", 1.0),
        ("rank", None),
        ("mode", "blocks"),
        ("mode", ""),
        ("mode", None),
        ("mode", 1),
        ("mode", ["contiguous"]),
        ("mode", {"contiguous": 1}),
        ("path", ""),
        ("path", "/a\0b.h5"),
        ("path", "\0"),
        ("path", "p" * (MAX_PATH_CHARS + 1)),
        ("path", 123),
        ("path", None),
        ("path", ["/a.h5"]),
        ("path", b"/a.h5"),
        ("key", ""),
        ("key", "k" * (MAX_KEY_CHARS + 1)),
        ("key", "x\0"),
        ("key", 1),
        ("key", None),
        ("dtype", ""),
        ("dtype", "d" * (MAX_DTYPE_CHARS + 1)),
        ("dtype", 4),
        ("dtype", "float\0"),
        ("dtype", ["float32"]),
    ],
)
def test_acquire_bad_field_value_is_rejected(field, value):
    with pytest.raises(ProtocolError):
        decode_request(acquire_frame(**{field: value}))


def test_acquire_rank_must_be_below_world_size():
    assert decode_request(acquire_frame(world_size=1, rank=0))[1].rank == 0
    assert_rejected(acquire_frame(world_size=1, rank=1))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"path": "", "key": "x", "world_size": 1, "rank": 0},
        {"path": "/a", "key": "x", "world_size": 0, "rank": 0},
        {"path": "/a", "key": "x", "world_size": 2, "rank": 2},
        {"path": "/a", "key": "x", "world_size": 2, "rank": 0, "mode": "nope"},
        {"path": "/a", "key": "x\0", "world_size": 2, "rank": 0},
        {"path": "/a", "key": "x", "world_size": 2, "rank": 0, "dtype": ""},
    ],
)
def test_acquire_constructor_validates(kwargs):
    with pytest.raises(ProtocolError):
        Acquire(**kwargs)


@pytest.mark.parametrize("field", ["path", "files"])
@pytest.mark.parametrize("relative", ["data.h5", "./data.h5", "../x/data.h5", "~/data.h5", " /data.h5"])
def test_acquire_refuses_a_relative_path(field, relative):
    """A relative path would be resolved from the daemon's working directory, not the sender's:
    refused on the wire, with what to do."""
    files = ["/a.h5", relative] if field == "files" else []
    frame = pack({"v": VERSION, "id": 9, "op": "acquire", "path": files[0] if files else relative, "key": "x",
                  "world_size": 1, "rank": 0, "files": files})
    with pytest.raises(ProtocolError, match=f"field '{field}' must be an absolute path.*pass an absolute path") as err:
        decode_request(frame)
    assert err.value.request_id == 9
    with pytest.raises(ProtocolError, match="absolute path"):
        Acquire(path=relative, key="x", world_size=1, rank=0)


def test_request_larger_than_max_frame_is_rejected():
    frame = pack({"v": VERSION, "id": 1, "op": "ping", "pad": "x" * MAX_FRAME_BYTES})
    assert len(frame) > MAX_FRAME_BYTES
    with pytest.raises(ProtocolError, match=f"at most {MAX_FRAME_BYTES} bytes"):
        decode_request(frame)


def test_oversized_random_frame_is_rejected():
    with pytest.raises(ProtocolError, match="at most"):
        decode_request(b"\x00" * (MAX_FRAME_BYTES + 1))


@pytest.mark.parametrize(
    "ext",
    [
        msgpack.ExtType(5, b"abc"),
        msgpack.ExtType(5, b""),  # zero-length ext passes max_ext_len=0
        msgpack.Timestamp(1, 0),
    ],
)
@pytest.mark.parametrize("where", ["path", "op", "v", "id", "mode", "extra"])
def test_ext_types_are_rejected(ext, where):
    assert_rejected(acquire_frame(**{where: ext}))


def test_ext_type_as_whole_frame_is_rejected():
    assert_rejected(pack(msgpack.ExtType(1, b"\x80")))
    assert_rejected(pack(msgpack.ExtType(1, b"")))


@pytest.mark.parametrize(
    "ext_bytes",
    [
        b"\xd6\xff\x00\x00\x00\x00",  # fixext4 timestamp
        b"\xc7\x00\xff",  # ext8, timestamp type, zero length (invalid timestamp)
        b"\xc7\x00\x80",  # ext8, negative reserved type -128, zero length
        b"\xd4\x05\x00",  # fixext1 application type
    ],
)
def test_raw_ext_values_are_rejected(ext_bytes):
    # {"v": 1, "id": 1, "op": <ext>} and {"v":1, "id":1, "op": "ping", "x": <ext>}
    head = b"\x83" + pack("v") + pack(VERSION) + pack("id") + pack(1) + pack("op")
    assert_rejected(head + ext_bytes)
    head = b"\x84" + pack("v") + pack(VERSION) + pack("id") + pack(1) + pack("op") + pack("ping") + pack("x")
    assert_rejected(head + ext_bytes)
    assert_rejected(ext_bytes)


def test_bin_values_are_rejected():
    assert_rejected(acquire_frame(key=b"x"))
    assert_rejected(acquire_frame(extra=b""))


def test_hostile_length_prefix_is_rejected_without_allocating():
    # array32 / map32 / str32 claiming 2**32-1 elements, with no payload
    for head in (b"\xdd", b"\xdf", b"\xdb", b"\xc6"):
        assert_rejected(head + b"\xff\xff\xff\xff")


def test_deep_nesting_is_rejected_with_a_protocol_error() -> None:
    deep = b"\x91" * 5000 + b"\xc0"  # [[[[...nil...]]]]
    assert_rejected(deep)
    nested_map = pack({"v": VERSION, "id": 1, "op": "ping", "x": [[[[[[[[1]]]]]]]]})
    assert_rejected(nested_map)


# --------------------------------------------------------------------------- fuzzing near-valid frames

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.binary(max_size=4),
    st.sampled_from(["contiguous", "interleave", "ping", "acquire", "status", "shutdown", "/a.h5", "a\0b"]),
    st.integers(min_value=-2, max_value=10),
)
_values = st.recursive(
    _scalars,
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.one_of(st.text(max_size=4), st.integers(0, 3)), children, max_size=3),
    max_leaves=6,
)
_field_names = st.sampled_from(sorted(VALID_ACQUIRE) + ["extra", "ok", "self"]) | st.text(max_size=6)


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=300)
@given(
    base_op=st.sampled_from(["acquire", "ping", "status", "shutdown"]),
    deletions=st.sets(st.sampled_from(sorted(VALID_ACQUIRE)), max_size=3),
    replacements=st.dictionaries(_field_names, _values, max_size=3),
)
def test_fuzzed_requests_are_valid_or_protocol_error(base_op, deletions, replacements):
    message = dict(VALID_ACQUIRE) if base_op == "acquire" else {"v": VERSION, "id": 1, "op": base_op}
    for name in deletions:
        message.pop(name, None)
    message.update(replacements)
    frame = pack(message)
    try:
        got_id, got = decode_request(frame)
    except ProtocolError:
        return
    # Accepted: it must be a fully valid request that re-encodes to the same thing.
    assert isinstance(got_id, int) and not isinstance(got_id, bool) and 0 <= got_id < 2**63
    assert isinstance(got, (Ping, Status, Shutdown, Acquire))
    assert message["op"] == type(got).OP
    if isinstance(got, Acquire):
        assert type(got.world_size) is int and 1 <= got.world_size <= MAX_WORLD_SIZE
        assert type(got.rank) is int and 0 <= got.rank < got.world_size
        assert got.mode in MODES and isinstance(got.mode, str)
        for text in (got.path, got.key):
            assert isinstance(text, str) and text and "\0" not in text
        assert got.dtype is None or (isinstance(got.dtype, str) and got.dtype and "\0" not in got.dtype)
    else:
        assert set(message) <= {"v", "id", "op"}
    assert decode_request(encode_request(got_id, got)) == (got_id, got)


# --------------------------------------------------------------------------- AcquireResult

VALID_RESULT = {
    "state": "ready",
    "name": "h5serve-0-abcd-0123",
    "shm_dir": "/dev/shm",
    "rows_done": 10,
    "rows_total": 10,
    "dataset_rows": 40,
    "uid": 0,
    "shm_dev": 0,
    "shm_ino": 0,
    "ino": 0,
    "ctime_ns": 0,
}


@pytest.mark.parametrize("state", ["ready", "loading"])
def test_acquire_result_round_trip(state):
    value = AcquireResult(state=state, name="seg", shm_dir="/dev/shm", rows_done=3, rows_total=10, dataset_rows=20,
                          uid=1000, ino=77, ctime_ns=1_700_000_000_123_456_789)
    wire = value.to_wire()
    assert wire == {"state": state, "name": "seg", "shm_dir": "/dev/shm", "rows_done": 3, "rows_total": 10,
                    "dataset_rows": 20, "uid": 1000, "shm_dev": 0, "shm_ino": 0, "ino": 77,
                    "ctime_ns": 1_700_000_000_123_456_789}
    assert AcquireResult.from_wire(wire) == value
    # and through a real reply frame
    got_id, result = decode_reply(encode_ok(8, wire))
    assert got_id == 8 and AcquireResult.from_wire(result) == value


def test_acquire_result_loading_before_resolution_has_no_name():
    # regression: the daemon answers "loading" with no name while its resolver thread still
    # opens the file; with 64 clients at once a client saw that reply and failed on it
    value = AcquireResult.from_wire({**VALID_RESULT, "state": "loading", "name": ""})
    assert value.state == "loading" and value.name == ""
    for bad in (None, 5, "a\0b"):
        with pytest.raises(ProtocolError):
            AcquireResult.from_wire({**VALID_RESULT, "state": "loading", "name": bad})


def test_acquire_result_defaults():
    value = AcquireResult.from_wire({"state": "loading", "name": "seg", "shm_dir": "/dev/shm"})
    assert (value.rows_done, value.rows_total, value.dataset_rows) == (0, 0, 0)


@pytest.mark.parametrize(
    "result",
    [
        {k: v for k, v in VALID_RESULT.items() if k != "state"},
        {k: v for k, v in VALID_RESULT.items() if k != "name"},
        {k: v for k, v in VALID_RESULT.items() if k != "shm_dir"},
        {**VALID_RESULT, "extra": 1},
        {**VALID_RESULT, "state": "done"},
        {**VALID_RESULT, "state": "READY"},
        {**VALID_RESULT, "state": None},
        {**VALID_RESULT, "state": ["ready"]},
        {**VALID_RESULT, "name": 5},
        {**VALID_RESULT, "name": None},
        {},
        None,
        [],
        "ready",
        ["ready", "x", "/dev/shm"],
        {1: "ready"},
    ],
)
def test_acquire_result_rejects_malformed(result):
    with pytest.raises(ProtocolError):
        AcquireResult.from_wire(result)


@pytest.mark.parametrize(
    "change",
    [
        {"shm_dir": 5},
        {"shm_dir": None},
        {"shm_dir": ""},
        {"name": ""},
        {"name": "a\0b"},
        {"rows_done": "a"},
        {"rows_done": True},
        {"rows_total": -1},
        {"dataset_rows": 1.5},
        {"dataset_rows": 2**63},
        {"ino": -1},
        {"ctime_ns": "1"},
    ],
)
def test_acquire_result_rejects_bad_field_types(change):
    # regression: only state and name used to be checked
    with pytest.raises(ProtocolError):
        AcquireResult.from_wire({**VALID_RESULT, **change})


def test_acquire_result_is_a_dataclass_with_wire_fields():
    # an arena block's slot and generation, sent only with a generation
    assert [f.name for f in dataclasses.fields(AcquireResult)] == [*VALID_RESULT, "slot", "generation"]


# ----- keys: one spelling per dataset (issue 21: equivalent keys were separate loads) -----------
@pytest.mark.parametrize("key, canonical", [
    ("x", "x"), ("/x", "x"), ("//x", "x"), ("x/", "x"), ("///x//", "x"),
    ("group/nested/x", "group/nested/x"), ("/group//nested///x/", "group/nested/x"),
    ("events:energy", "events:energy"), ("/events:energy", "events:energy"),  # compound fields keep their ':'
    ("runs:2024:energy", "runs:2024:energy"), ("a//b:c", "a/b:c"), (".hidden/x", ".hidden/x"), ("a/...", "a/..."),
])
def test_equivalent_keys_have_one_spelling(key: str, canonical: str) -> None:
    from h5serve.wire.protocol import normalise_key

    assert normalise_key(key) == canonical
    request = Acquire("/data/train.h5", key, 1, 0)
    assert request.key == canonical
    assert decode_request(encode_request(5, request))[1] == request  # the same segment on both sides


@pytest.mark.parametrize("key", ["/", "//", "./x", "x/.", "a/../b", "..", "a/./b"])
def test_keys_with_dot_components_or_no_name_are_refused(key: str) -> None:
    from h5serve.errors import ConfigError

    with pytest.raises(ConfigError, match="key"):
        Acquire("/data/train.h5", key, 1, 0)
    frame = msgpack.packb({**VALID_ACQUIRE, "id": 9, "key": key})
    with pytest.raises(ConfigError) as caught:
        decode_request(frame)
    assert caught.value.request_id == 9  # type: ignore[attr-defined]  # the daemon's error reply names the request
