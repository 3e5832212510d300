"""The wire protocol between clients and the daemon: msgpack maps over ZeroMQ.

Every request is one frame ``{"v": VERSION, "id": <int>, "op": <str>, ...fields}``; every
reply is ``{"v": VERSION, "id": <same int>, "ok": true, "result": {...}}`` or
``{"v": VERSION, "id": <same int>, "ok": false, "code": <str>, "message": <str>}``, where
``code`` is a key of ``h5serve.errors.ERROR_CODES``.

Decoding is strict: msgpack limits stop a hostile length from allocating memory, every field
is type- and range-checked, unknown ops and fields are refused. No pickle, no eval.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from ..errors import ConfigError, H5ServeError, ProtocolError, error_from_code
from ..order.sharding import STREAM, WIRE_MODES
from ..util.checks import is_int

__all__ = [
    "VERSION",
    "MAX_FRAME_BYTES",
    "MAX_FILES_FRAME_BYTES",
    "POLL_INTERVAL_S",
    "Ping",
    "Status",
    "Shutdown",
    "Acquire",
    "AcquireResult",
    "Request",
    "encode_request",
    "decode_request",
    "encode_ok",
    "encode_error",
    "decode_reply",
    "MAX_REPLY_BYTES",
    "MAX_FILES",
    "MAX_PATH_CHARS", "MAX_KEY_CHARS", "REMOTE_PREFIXES",
    "MAX_WORLD_SIZE",
    "normalise_key",
]

VERSION = 1
# How often the daemon's loop wakes, and the longest pause between a client's polls of a load
# in progress: the same pace on both sides, so a client never polls faster than the daemon answers.
POLL_INTERVAL_S = 0.05
MAX_FRAME_BYTES = 64 * 1024  # requests are small; a reply with many segments stays far below 16 MiB
MAX_REPLY_BYTES = 16 * 1024 * 1024
MAX_PATH_CHARS = 4096
MAX_KEY_CHARS = 1024
MAX_WORLD_SIZE = 1 << 20
MAX_DTYPE_CHARS = 32
# An acquire naming many files (``files``) may be larger than MAX_FRAME_BYTES, up to this
# (under the daemon's ZeroMQ MAXMSGSIZE of 1 MiB, so it is answered, never dropped); the client
# refuses longer lists before sending (files.py: MAX_FILES, MAX_FILES_PATH_BYTES).
MAX_FILES_FRAME_BYTES = 1000 * 1024
MAX_FILES = 4096
REMOTE_PREFIXES = ("s3://",)  # the URLs an acquire may name (the daemon fetches them: docs/architecture.md)


@dataclass(frozen=True)
class Ping:
    """Is a daemon there? Answered with its pid, version and shm dir, its memory budget and the
    shared memory its segments use now (``budget``, ``used``: the totals ``status`` shows
    everyone, without listing every segment; a client polling memory asks this)."""

    OP: ClassVar[str] = "ping"


@dataclass(frozen=True)
class Status:
    """Everything the daemon holds: segments, memory, counters."""

    OP: ClassVar[str] = "status"


@dataclass(frozen=True)
class Shutdown:
    """Stop the daemon gracefully (its segments are unlinked)."""

    OP: ClassVar[str] = "shutdown"


@dataclass(frozen=True)
class Acquire:
    """Load (or find) the segment holding ``rank``'s shard of ``path[key]`` as ``dtype``
    (``mode="global"``: the whole dataset, the same segment for every rank and world size;
    ``mode="node"``: the contiguous shards of ranks ``rank .. rank + span - 1``, one block).
    ``files``: many files as one dataset, their rows concatenated in this order (absolute
    paths, never a pattern; ``path`` is the first); empty for one file, and then not sent,
    so a one-file request is the same message as before.

    Answered at once with an AcquireResult: ``ready`` with the segment name, or ``loading``
    with progress (the client asks again), never blocked on the load itself. ``key`` may name
    a field of a compound dataset, ``"<dataset>:<field>"`` (h5serve/hdf5/compound.py): the segment
    holds that field only.

    ``mode="stream"``: one block of stream mode, the global rows ``rows = (start, stop)``
    (required there, refused elsewhere; not sent otherwise, so other requests are the messages
    they were). ``world_size`` and ``rank`` only say who asked: the segment is the rows', the
    same for every rank and job. The daemon checks ``stop`` against the dataset's rows once
    the file is resolved (ConfigError). ``prefetch=True`` (stream only; not sent when false):
    the block is asked for ahead of need; when it must be loaded and the budget is full, the
    daemon makes room only by evicting blocks some request needed (never blocks loaded for a
    prefetch that nobody has needed yet: another rank's or job's next blocks), and otherwise
    refuses it (BudgetExceeded) instead of evicting.
    """

    OP: ClassVar[str] = "acquire"
    path: str
    key: str
    world_size: int
    rank: int
    mode: str = "contiguous"
    dtype: str | None = None
    span: int = 1  # mode="node": the node's ranks are rank .. rank + span - 1
    files: tuple[str, ...] = ()  # many files as one dataset (files.py): every path, in row order
    rows: tuple[int, int] | None = None  # mode="stream": the block's global rows [start, stop)
    prefetch: bool = False  # mode="stream": asked ahead of need (the daemon refuses rather than evict for it)
    # mode="stream": the block's rows in a slot of the key's arena of
    # slots of this many rows (segments/arena.py), not a segment of its own; 0: not sent
    arena: int = 0
    # an s3:// object (``path`` is its URL): its identity as the client described it, [size, ETag, version id]
    # ("" when the store gives none); the daemon serves only that version. Not sent for a local file.
    pin: tuple[int, str, str] | None = None
    # many s3:// objects as one dataset (``files`` their URLs): each one's identity, in ``files``' order. Not sent
    # otherwise.
    pins: tuple[tuple[int, str, str], ...] = ()

    def __post_init__(self) -> None:
        _check_str("path", self.path, MAX_PATH_CHARS)
        if isinstance(self.pins, list) and not self.pins:
            object.__setattr__(self, "pins", ())
        if self.pins != ():
            self._check_remote_files()
        elif self.pin is not None:
            self._check_remote()
        else:
            _check_absolute("path", self.path)
        if isinstance(self.files, list) and not self.files:
            object.__setattr__(self, "files", ())  # an empty list on the wire: one file
        if self.files != ():
            if not isinstance(self.files, (list, tuple)) or not 2 <= len(self.files) <= MAX_FILES:
                raise ProtocolError(f"field 'files' must be a list of 2 to {MAX_FILES} paths")
            for path in self.files:
                _check_str("files", path, MAX_PATH_CHARS)
                if not self.pins:
                    _check_absolute("files", path)
            if self.files[0] != self.path:
                raise ProtocolError("field 'files' must start with 'path'")
            object.__setattr__(self, "files", tuple(self.files))
        _check_str("key", self.key, MAX_KEY_CHARS)
        object.__setattr__(self, "key", normalise_key(self.key))
        _check_int("world_size", self.world_size, 1, MAX_WORLD_SIZE)
        _check_int("rank", self.rank, 0, self.world_size - 1)
        if self.mode not in WIRE_MODES:
            raise ProtocolError(f"field 'mode' must be one of {WIRE_MODES}, got {self.mode!r}")
        if self.mode == STREAM:
            if not isinstance(self.rows, (list, tuple)) or len(self.rows) != 2:
                raise ProtocolError(f"field 'rows' must be [start, stop] in mode 'stream', got {self.rows!r:.80}")
            _check_int("rows", self.rows[0], 0, 2**63 - 2)
            _check_int("rows", self.rows[1], self.rows[0] + 1, 2**63 - 1)
            object.__setattr__(self, "rows", (self.rows[0], self.rows[1]))
        elif self.rows is not None:
            raise ProtocolError(f"field 'rows' is for mode 'stream' only, not {self.mode!r}")
        if not isinstance(self.prefetch, bool):
            raise ProtocolError(f"field 'prefetch' must be true or false, got {self.prefetch!r:.80}")
        if self.prefetch and self.mode != STREAM:
            raise ProtocolError(f"field 'prefetch' is for mode 'stream' only, not {self.mode!r}")
        _check_int("arena", self.arena, 0, 2**40)
        if self.arena and self.mode != STREAM:
            raise ProtocolError(f"field 'arena' is for mode 'stream' only, not {self.mode!r}")
        _check_int("span", self.span, 1, self.world_size - self.rank)
        if self.span != 1 and self.mode != "node":
            raise ProtocolError(f"field 'span' must be 1 outside mode 'node', got {self.span}")
        if self.dtype is not None:
            _check_str("dtype", self.dtype, MAX_DTYPE_CHARS)

    def _check_remote(self) -> None:
        """An object of a store: ``path`` an ``s3://`` URL, one file, and ``pin`` its identity."""
        if not self.path.startswith(REMOTE_PREFIXES):
            raise ProtocolError(f"field 'pin' is for {' and '.join(REMOTE_PREFIXES)} URLs only, got path "
                                f"{self.path[:80]!r}")
        if self.files:
            raise ProtocolError("field 'files' must be empty for a URL (the daemon fetches one object per request)")
        pin = self.pin
        object.__setattr__(self, "pin", _checked_pin(pin))

    def _check_remote_files(self) -> None:
        """Many objects of a store: every path of ``files`` an ``s3://`` URL, ``pins`` their identities."""
        if self.pin is not None:
            raise ProtocolError("fields 'pin' and 'pins' exclude each other (one object, or many)")
        files, pins = self.files, self.pins
        if (not isinstance(pins, (list, tuple)) or not isinstance(files, (list, tuple))
                or len(pins) != len(files) or len(files) < 2):
            raise ProtocolError("field 'pins' must give one identity for each of 'files' (2 or more)")
        for path in files:
            if not isinstance(path, str) or not path.startswith(REMOTE_PREFIXES):
                raise ProtocolError(f"field 'pins' is for {' and '.join(REMOTE_PREFIXES)} URLs only, got file "
                                    f"{str(path)[:80]!r}")
        object.__setattr__(self, "pins", tuple(_checked_pin(p) for p in pins))


def _checked_pin(pin: object) -> tuple[int, str, str]:
    """An object's identity on the wire, [size, ETag, version id], as a tuple. Raised otherwise: ProtocolError."""
    if (not isinstance(pin, (list, tuple)) or len(pin) != 3 or not is_int(pin[0]) or pin[0] < 0
            or not all(isinstance(v, str) and len(v) <= MAX_KEY_CHARS for v in pin[1:])):
        raise ProtocolError(f"field 'pin' must be [size, etag, version id], got {pin!r:.80}")
    return (pin[0], pin[1], pin[2])


Request = Ping | Status | Shutdown | Acquire
REQUEST_TYPES: dict[str, type] = {cls.OP: cls for cls in (Ping, Status, Shutdown, Acquire)}


@dataclass(frozen=True)
class AcquireResult:
    """Reply to Acquire: ``state`` is ``ready`` (``name`` can be attached) or ``loading``
    (``name`` is empty while the daemon is still resolving the file off its loop)."""

    state: str
    name: str
    shm_dir: str
    rows_done: int = 0
    rows_total: int = 0  # rows in this shard
    dataset_rows: int = 0  # rows in the whole dataset, before sharding
    uid: int = 0  # the daemon's uid: the only owner a client accepts for the segment file
    shm_dev: int = 0  # st_dev and st_ino of shm_dir as the daemon sees it: a client that sees
    shm_ino: int = 0  # another filesystem there does not share the daemon's /dev/shm
    # ready: the segment file's st_ino and st_ctime_ns as the daemon recorded them when it was
    # published; a client maps only a file that still has both (0: not known, not checked)
    ino: int = 0
    ctime_ns: int = 0
    # an arena block (Acquire.arena): its slot in the arena ``name`` and the slot's
    # generation when the daemon answered (the rank checks both in the slot table under its lock)
    slot: int = 0
    generation: int = 0

    def to_wire(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self)
        if not self.generation:  # not an arena block (generations start at 1): the reply as before
            del fields["slot"], fields["generation"]
        return fields

    @classmethod
    def from_wire(cls, result: dict[str, Any]) -> AcquireResult:
        try:
            value = cls(**result)
        except TypeError as exc:
            raise ProtocolError(f"malformed acquire result: {exc}") from exc
        if value.state not in ("ready", "loading"):
            raise ProtocolError(f"malformed acquire result: state {value.state!r}")
        if not (value.state == "loading" and value.name == ""):  # no name yet while the file is resolved
            _check_str("name", value.name, MAX_PATH_CHARS)
        _check_str("shm_dir", value.shm_dir, MAX_PATH_CHARS)
        for name in ("rows_done", "rows_total", "dataset_rows", "uid", "shm_dev", "shm_ino", "ino", "ctime_ns",
                     "slot", "generation"):
            _check_int(name, getattr(value, name), 0, 2**63 - 1)
        return value


def _check_absolute(name: str, path: str) -> None:
    """A relative path would be resolved from the daemon's working directory, not the sender's."""
    if not path.startswith("/"):
        raise ProtocolError(f"field {name!r} must be an absolute path, got {path!r}; pass an absolute path "
                            "(h5serve.client and `h5serve preload` do)")


def normalise_key(key: str) -> str:
    """The one spelling of an HDF5 key: ``"//a/b/"``, ``"/a//b"`` and ``"a/b"`` name the same
    object (HDF5 resolves every key from the root, ignoring repeated and trailing slashes), so
    they are one segment, one load. A compound field (``"ds:field"``, hdf5/compound.py) keeps
    its ``:`` and field name; only slashes change.

    Raised when a component is ``.`` or ``..`` (HDF5 skips ``.``, so ``"a/./b"`` would be a
    second spelling of ``"a/b"``; ``..`` is no parent in HDF5 and reads as one), or nothing is
    left but slashes: ConfigError.
    """
    parts = [part for part in key.split("/") if part]
    if not parts:
        raise ConfigError(f"key {key!r} names no dataset; give the dataset's path in the file, e.g. 'images'")
    if any(part in (".", "..") for part in parts):
        raise ConfigError(f"key {key!r} has a '.' or '..' component; name the dataset by its path from the "
                          "file's root, without them (e.g. 'group/images')")
    return "/".join(parts)


def _check_str(name: str, value: object, max_len: int) -> None:
    if not isinstance(value, str) or not value or len(value) > max_len or "\0" in value:
        raise ProtocolError(f"field {name!r} must be a non-empty string of at most {max_len} characters")


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if not is_int(value) or not low <= value <= high:
        raise ProtocolError(f"field {name!r} must be an integer in [{low}, {high}], got {value!r}")


def _unpack_map(frame: bytes, max_bytes: int) -> dict[str, Any]:
    if not isinstance(frame, (bytes, bytearray, memoryview)) or len(frame) > max_bytes:
        raise ProtocolError(f"frame must be at most {max_bytes} bytes")
    try:
        message = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_str_len=max_bytes,
            max_bin_len=0,
            max_ext_len=0,
            max_array_len=max_bytes,
            max_map_len=max_bytes,
        )
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"frame is not valid msgpack: {type(exc).__name__}: {exc}") from exc
    if not isinstance(message, dict):
        raise ProtocolError("frame must be a msgpack map")
    _check_int("id", message.get("id"), 0, 2**63 - 1)
    version = message.get("v")
    if type(version) is not int or version != VERSION:
        error = ProtocolError(
            f"protocol version {version!r} is not this side's {VERSION}: the daemon and the client run "
            "different h5serve versions; restart the daemon with the client's version (h5serve stop; h5serve start)"
        )
        error.request_id = message["id"]  # so the peer can match the error to its request
        raise error
    return message


def encode_request(request_id: int, request: Request) -> bytes:
    fields = {f.name: getattr(request, f.name) for f in dataclasses.fields(request)}
    if not fields.get("files", True):  # one file: the message older daemons know
        del fields["files"]
    if "rows" in fields and fields["rows"] is None:  # not a stream block: the message as before
        del fields["rows"]
    if fields.get("prefetch") is False:  # not a prefetch: the message as before
        del fields["prefetch"]
    if fields.get("arena") == 0:  # not an arena block: the message as before
        del fields["arena"]
    if "pin" in fields and fields["pin"] is None:  # a local file: the message as before
        del fields["pin"]
    if "pins" in fields and not fields["pins"]:  # not many objects: the message as before
        del fields["pins"]
    return msgpack.packb({"v": VERSION, "id": request_id, "op": request.OP, **fields})


def decode_request(frame: bytes) -> tuple[int, Request]:
    """Parse one request frame. Raised when it is malformed in any way: ProtocolError.

    Frames over MAX_FRAME_BYTES are read only as an acquire naming many files (``files``),
    up to MAX_FILES_FRAME_BYTES."""
    if isinstance(frame, (bytes, bytearray, memoryview)) and MAX_FRAME_BYTES < len(frame) <= MAX_FILES_FRAME_BYTES:
        request_id = 0
        try:
            message = _unpack_map(frame, MAX_FILES_FRAME_BYTES)
        except ProtocolError as exc:
            message, request_id = {}, exc.request_id
        if message.get("op") != "acquire" or not message.get("files"):
            error = ProtocolError(f"frame must be at most {MAX_FRAME_BYTES} bytes ({MAX_FILES_FRAME_BYTES} for an "
                                  "acquire naming many files)")
            error.request_id = message.get("id", request_id)
            raise error
    else:
        message = _unpack_map(frame, MAX_FRAME_BYTES)
    request_id = message.pop("id")
    message.pop("v")
    op = message.pop("op", None)
    cls = REQUEST_TYPES.get(op) if isinstance(op, str) else None
    try:
        if cls is None:
            raise ProtocolError(f"unknown op {op!r}; known ops: {', '.join(sorted(REQUEST_TYPES))}")
        try:
            return request_id, cls(**message)
        except TypeError as exc:  # missing or unexpected fields
            raise ProtocolError(f"bad fields for op {op!r}: {exc}") from exc
    except ProtocolError as exc:
        exc.request_id = request_id  # the envelope was fine: the error reply can name the request
        raise
    except ConfigError as exc:  # a key normalise_key refuses: the reply names the request too
        exc.request_id = request_id  # type: ignore[attr-defined]
        raise


def encode_ok(request_id: int, result: dict[str, Any]) -> bytes:
    return msgpack.packb({"v": VERSION, "id": request_id, "ok": True, "result": result})


def encode_error(request_id: int, code: str, message: str) -> bytes:
    return msgpack.packb({"v": VERSION, "id": request_id, "ok": False, "code": code, "message": message})


def decode_reply(frame: bytes) -> tuple[int, dict[str, Any] | H5ServeError]:
    """Parse a reply: its request id, and its result or the error it carries (the
    H5ServeError subclass named by its code, for the caller to raise once the id matches).

    Raised when the frame is malformed: ProtocolError.
    """
    message = _unpack_map(frame, MAX_REPLY_BYTES)
    if message.get("ok") is True and isinstance(message.get("result"), dict):
        return message["id"], message["result"]
    if message.get("ok") is False and isinstance(message.get("code"), str):
        return message["id"], error_from_code(message["code"], str(message.get("message", "")))
    raise ProtocolError(f"malformed reply: {message!r:.200}")
