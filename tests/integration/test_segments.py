"""Unit tests for h5serve.segments: naming, header, create, publish, attach, lease, evict.

Real files, real mmap, real flock, real child processes; no mocks.
"""

import dataclasses
import os
import secrets
import select
import shutil
import signal
import stat
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import msgpack
import numpy as np
import pytest

from h5serve.errors import CapacityError, SegmentError, ShmFull
from h5serve.segments import (
    HEADER_SIZE,
    SegmentMeta,
    attach_segment,
    create_segment,
    fresh_name,
    is_published_as,
    read_meta,
    read_progress,
    segment_name,
    segment_prefix,
    temporary_name,
    temporary_owner_pid,
    try_evict,
)
from h5serve.util.units import format_bytes

from ..helpers import NAMESPACE, SECRET, make_meta, sample_data


def publish_segment(shm_dir, meta=None, data=None):
    """Create, fill and publish a segment; returns (final name, final path, data written)."""
    meta = meta or make_meta()
    name = segment_name(NAMESPACE, meta, SECRET)
    writer = create_segment(shm_dir, temporary_name(NAMESPACE), meta)
    data = sample_data(meta) if data is None else data
    writer.data[...] = data
    path = writer.publish(name)
    return name, path, data


def _patch(path, offset, data):
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def spawn_python(code, *args):
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def read_line(proc, timeout=10.0):
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"child printed nothing within {timeout}s")
    line = proc.stdout.readline().strip()
    if not line:
        proc.wait(timeout=5)
        raise AssertionError(f"child exited early ({proc.returncode}): {proc.stderr.read()}")
    return line


def kill(proc):
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=5)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


# --------------------------------------------------------------------------- naming


def test_segment_name_is_deterministic():
    a, b = make_meta(), make_meta()
    assert a is not b
    assert segment_name(NAMESPACE, a, SECRET) == segment_name(NAMESPACE, b, SECRET)


def test_segment_name_shape():
    name = segment_name(NAMESPACE, make_meta(), SECRET)
    assert name.startswith(segment_prefix(NAMESPACE))
    assert segment_prefix(NAMESPACE) == f"h5serve-{os.getuid()}-{NAMESPACE}-"
    assert "/" not in name and ".tmp-" not in name and "\0" not in name
    assert len(name) < 255
    assert temporary_owner_pid(name) is None


@pytest.mark.parametrize(
    "field, value",
    [
        ("source_path", "/data/other.h5"),
        ("source_dev", 64770),
        ("source_ino", 123457),
        ("source_size", 987655),
        ("source_mtime_ns", 1_700_000_000_123_456_790),
        ("key", "y"),
        ("mode", "interleave"),
        ("world_size", 4),
        ("rank", 0),
        ("dtype", "uint8"),
    ],
)
def test_segment_name_changes_with_every_identity_field(field, value):
    base = make_meta()
    changed = dataclasses.replace(base, **{field: value})
    assert getattr(changed, field) != getattr(base, field)
    assert segment_name(NAMESPACE, changed, SECRET) != segment_name(NAMESPACE, base, SECRET)


def test_segment_name_changes_with_namespace():
    meta = make_meta()
    assert segment_name("ns000001", meta, SECRET) != segment_name("ns000002", meta, SECRET)


def test_temporary_name_round_trip():
    """A temporary names its daemon's prefix and pid, never the segment it becomes (issue 21:
    ``<final>.tmp-...`` told anyone which name to take before the publish)."""
    final = segment_name(NAMESPACE, make_meta(), SECRET)
    tmp = temporary_name(NAMESPACE)
    assert tmp.startswith(segment_prefix(NAMESPACE) + "tmp-")
    assert final[len(segment_prefix(NAMESPACE)):] not in tmp
    assert len(tmp.rsplit("-", 1)[1]) == 32  # 128 random bits
    assert temporary_owner_pid(tmp) == os.getpid()
    assert temporary_name(NAMESPACE) != tmp  # random suffix: two loads never collide
    assert temporary_owner_pid(f"{final}.tmp-4242-abcdef") == 4242  # what earlier versions left
    assert temporary_owner_pid(fresh_name(final)) is None


def test_fresh_names_of_a_segment():
    final = segment_name(NAMESPACE, make_meta(), SECRET)
    fresh = fresh_name(final)
    assert fresh != fresh_name(final) and fresh.startswith(final + "-")
    assert is_published_as(final, final) and is_published_as(fresh, final)
    for other in (final + "-", final + "-xyz", final + "x", temporary_name(NAMESPACE), fresh + "0", final[:-1]):
        assert not is_published_as(other, final), other


def test_publish_under_a_fresh_name_when_a_foreign_file_holds_the_name(tmp_path):
    """Another user's file (or a symlink, a FIFO) at the final name is left alone; the segment
    is published under a fresh name of it, and attaches."""
    meta = make_meta()
    name = segment_name(NAMESPACE, meta, SECRET)
    # another user's file needs root to plant here (a file of our own at the name is replaced)
    for plant in ("file", "fifo", "symlink") if os.geteuid() == 0 else ("fifo", "symlink"):
        target = tmp_path / name
        if plant == "file":
            target.write_bytes(b"planted")
            os.chown(target, 65534, 65534)
        elif plant == "fifo":
            os.mkfifo(target)
        else:
            target.symlink_to(tmp_path / "elsewhere")
        writer = create_segment(tmp_path, temporary_name(NAMESPACE), meta)
        writer.data[...] = sample_data(meta)
        path = writer.publish(name)
        assert path.name != name and is_published_as(path.name, name), plant
        assert attach_segment(tmp_path, path.name).meta == meta
        st = os.lstat(target)
        assert {"file": stat.S_ISREG, "fifo": stat.S_ISFIFO, "symlink": stat.S_ISLNK}[plant](st.st_mode)
        target.unlink()
        path.unlink()


@pytest.mark.parametrize("filename", ["h5serve-0-ns-abc", "x.tmp-", "x.tmp-abc-123", "x.tmp--1", "plain"])
def test_temporary_owner_pid_of_non_temporaries(filename):
    assert temporary_owner_pid(filename) is None


@pytest.mark.parametrize(
    "n, text",
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (4 * 1024**2 + 4096, "4.0 MiB"), (3 * 1024**3, "3.0 GiB"),
     (5 * 1024**5, "5120.0 TiB")],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


# --------------------------------------------------------------------------- metadata


def test_meta_sizes():
    meta = make_meta(rows=6, row_shape=(3, 4), dtype="float32")
    assert meta.nbytes == 6 * 12 * 4
    assert meta.file_size == HEADER_SIZE + meta.nbytes
    assert meta.np_dtype == np.dtype("float32")
    assert make_meta(rows=0).nbytes == 0
    assert make_meta(rows=5, row_shape=()).nbytes == 5 * 4  # scalar rows


def test_meta_wire_round_trip():
    meta = make_meta(row_shape=(2, 3, 5), dtype="<u2")
    wire = meta.to_wire()
    assert wire["row_shape"] == [2, 3, 5]
    assert SegmentMeta.from_wire(wire) == meta
    # through msgpack, as it is stored in the header
    again = SegmentMeta.from_wire(msgpack.unpackb(msgpack.packb(wire), raw=False))
    assert again == meta
    assert isinstance(again.row_shape, tuple)


def test_meta_wire_round_trip_scalar_rows():
    meta = make_meta(row_shape=())
    assert SegmentMeta.from_wire(meta.to_wire()) == meta


@pytest.mark.parametrize(
    "mutate",
    [
        lambda w: w.pop("key"),
        lambda w: w.update(extra=1),
        lambda w: w.update(dtype="not-a-dtype"),
        lambda w: w.update(row_shape=5),
        lambda w: w.update(row_shape=["a"]),
    ],
    ids=["missing", "extra", "bad dtype", "row_shape int", "row_shape str"],
)
def test_meta_from_wire_rejects_invalid(mutate):
    wire = make_meta().to_wire()
    mutate(wire)
    with pytest.raises(SegmentError):
        SegmentMeta.from_wire(wire)


@pytest.mark.parametrize("data", [None, [], "meta", 5])
def test_meta_from_wire_rejects_non_dict(data):
    with pytest.raises(SegmentError):
        SegmentMeta.from_wire(data)


# --------------------------------------------------------------------------- create / publish / attach


def test_create_publish_attach(tmp_path):
    meta = make_meta()
    name = segment_name(NAMESPACE, meta, SECRET)
    tmp = temporary_name(NAMESPACE)
    writer = create_segment(tmp_path, tmp, meta)
    try:
        tmp_file = tmp_path / tmp
        assert tmp_file.exists()
        assert stat.S_IMODE(tmp_file.stat().st_mode) == 0o600
        assert tmp_file.stat().st_size == meta.file_size  # fully reserved up front
        assert writer.data.shape == (meta.rows, *meta.row_shape)
        assert writer.data.dtype == meta.np_dtype
        assert writer.data.flags.writeable
        expected = sample_data(meta)
        writer.data[...] = expected
        assert read_meta(tmp_file) == (meta, False)
        # not published yet: the final name does not exist and cannot be attached
        assert not (tmp_path / name).exists()
        with pytest.raises(SegmentError):
            attach_segment(tmp_path, name)
        final = writer.publish(name)
    except BaseException:
        writer.abort()
        raise
    assert final == tmp_path / name
    assert not tmp_file.exists()
    assert final.exists()
    assert os.listdir(tmp_path) == [name]
    assert stat.S_IMODE(final.stat().st_mode) == 0o400  # read-only once published
    assert final.stat().st_size == meta.file_size
    assert read_meta(final) == (meta, True)
    assert read_progress(final) == (meta.rows, meta.rows)

    seg = attach_segment(tmp_path, name)
    try:
        assert seg.name == name
        assert seg.path == final
        assert seg.meta == meta
        assert seg.data.shape == (meta.rows, *meta.row_shape)
        assert seg.data.dtype == meta.np_dtype
        np.testing.assert_array_equal(seg.data, expected)
        assert seg.data.flags.c_contiguous
    finally:
        seg.close()
    assert seg.data is None


def test_attached_data_is_read_only(tmp_path):
    name, path, expected = publish_segment(tmp_path)
    seg = attach_segment(tmp_path, name)
    try:
        assert seg.data.flags.writeable is False
        with pytest.raises(ValueError):
            seg.data[0, 0, 0] = 99
        with pytest.raises(ValueError):
            seg.data += 1
        with pytest.raises(ValueError):  # the flag cannot be flipped back: the mapping is PROT_READ
            seg.data.flags.writeable = True
        view = seg.data[1:3]
        assert view.flags.writeable is False
        with pytest.raises(ValueError):
            view[...] = 0
        # a gather copies into a fresh, writable buffer
        rows = np.take(seg.data, [0, 2], axis=0)
        rows += 1
        np.testing.assert_array_equal(seg.data, expected)
    finally:
        seg.close()
    # and nothing changed on disk
    seg = attach_segment(tmp_path, name)
    try:
        np.testing.assert_array_equal(seg.data, expected)
    finally:
        seg.close()


def test_writer_progress_is_visible(tmp_path):
    meta = make_meta(rows=10, row_shape=(2,))
    writer = create_segment(tmp_path, "seg.tmp-1-aaaaaa", meta)
    try:
        assert read_progress(tmp_path / "seg.tmp-1-aaaaaa") == (0, 10)
        writer.set_progress(4)
        assert read_progress(tmp_path / "seg.tmp-1-aaaaaa") == (4, 10)
    finally:
        writer.abort()
    assert not (tmp_path / "seg.tmp-1-aaaaaa").exists()
    assert read_progress(tmp_path / "seg.tmp-1-aaaaaa") == (0, 0)


def test_writer_abort_removes_temporary(tmp_path):
    meta = make_meta()
    writer = create_segment(tmp_path, temporary_name("seg"), meta)
    writer.data[...] = 1
    writer.abort()
    assert os.listdir(tmp_path) == []
    writer.abort()  # idempotent


def test_zero_row_segment(tmp_path):
    meta = make_meta(rows=0, row_shape=(3, 4), total_rows=1)
    name, path, _ = publish_segment(tmp_path, meta)
    assert path.stat().st_size == HEADER_SIZE
    seg = attach_segment(tmp_path, name)
    try:
        assert seg.data.shape == (0, 3, 4)
        assert seg.data.dtype == np.float32
        assert seg.data.flags.writeable is False
        assert seg.meta.rows == 0
    finally:
        seg.close()
    assert try_evict(path)
    assert not path.exists()


def test_scalar_row_segment(tmp_path):
    meta = make_meta(rows=7, row_shape=(), dtype="int64")
    name, path, expected = publish_segment(tmp_path, meta)
    seg = attach_segment(tmp_path, name)
    try:
        assert seg.data.shape == (7,)
        np.testing.assert_array_equal(seg.data, expected)
    finally:
        seg.close()


def test_create_refuses_existing_temporary(tmp_path):
    meta = make_meta()
    writer = create_segment(tmp_path, "seg.tmp-1-aaaaaa", meta)
    try:
        with pytest.raises(FileExistsError):
            create_segment(tmp_path, "seg.tmp-1-aaaaaa", meta)
        assert (tmp_path / "seg.tmp-1-aaaaaa").exists()  # the first one is untouched
    finally:
        writer.abort()


def test_create_rejects_oversized_metadata_and_cleans_up(tmp_path):
    meta = make_meta(key="k" * (HEADER_SIZE + 100))
    with pytest.raises(SegmentError, match="too large"):
        create_segment(tmp_path, "seg.tmp-1-aaaaaa", meta)
    assert os.listdir(tmp_path) == []


def test_segment_in_dev_shm():
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    meta = make_meta(source_path=f"/tmp/h5serve-test-{secrets.token_hex(8)}.h5")
    name = f"h5serve-test-{os.getpid()}-{secrets.token_hex(6)}"
    tmp = temporary_name(NAMESPACE)
    seg = None
    try:
        writer = create_segment(shm, tmp, meta)
        expected = sample_data(meta)
        writer.data[...] = expected
        path = writer.publish(name)
        assert not (shm / tmp).exists()
        assert path == shm / name and path.exists()
        assert stat.S_IMODE(path.stat().st_mode) == 0o400
        seg = attach_segment(shm, name)
        np.testing.assert_array_equal(seg.data, expected)
        assert seg.data.flags.writeable is False
        assert not try_evict(path)
        seg.close()
        seg = None
        assert try_evict(path)
        assert not path.exists()
    finally:
        if seg is not None:
            seg.close()
        for leftover in (shm / tmp, shm / name):
            try:
                os.unlink(leftover)
            except FileNotFoundError:
                pass


# --------------------------------------------------------------------------- attach refusals


def test_attach_missing_name(tmp_path):
    with pytest.raises(SegmentError, match="cannot be opened"):
        attach_segment(tmp_path, "h5serve-0-ns-doesnotexist")


def test_attach_refuses_temporary_name(tmp_path):
    meta = make_meta()
    tmp = temporary_name(NAMESPACE)
    writer = create_segment(tmp_path, tmp, meta)
    try:
        writer.data[...] = sample_data(meta)
        with pytest.raises(SegmentError, match="not a published segment name"):
            attach_segment(tmp_path, tmp)
    finally:
        writer.abort()


@pytest.mark.parametrize("name", ["sub/seg", "../seg", "/etc/passwd"])
def test_attach_refuses_names_with_slash(tmp_path, name):
    with pytest.raises(SegmentError, match="not a published segment name"):
        attach_segment(tmp_path, name)


def test_attach_refuses_symlink(tmp_path):
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    name, path, _ = publish_segment(real_dir)
    os.symlink(path, shm_dir / name)
    with pytest.raises(SegmentError):
        attach_segment(shm_dir, name)


def test_attach_refuses_bad_magic(tmp_path):
    # everything valid except the magic
    name, path, _ = publish_segment(tmp_path)
    _patch(path, 0, b"NOTMAGIC")
    with pytest.raises(SegmentError, match=r"\(bad magic\)"):
        attach_segment(tmp_path, name)


def test_attach_refuses_a_segment_made_writable_after_publishing(tmp_path):
    """Published segments are read-only; one made writable again (by its owner, or root) may
    have been changed under every reader: never mapped."""
    name, path, _ = publish_segment(tmp_path)
    attach_segment(tmp_path, name).close()
    os.chmod(path, 0o600)
    with pytest.raises(SegmentError, match="is writable"):
        attach_segment(tmp_path, name)


def test_attach_refuses_foreign_file(tmp_path):
    (tmp_path / "seg").write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * (HEADER_SIZE * 2 - 8))
    with pytest.raises(SegmentError, match="not an h5serve segment"):
        attach_segment(tmp_path, "seg")


def test_attach_refuses_empty_and_short_file(tmp_path):
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(SegmentError, match="truncated"):
        attach_segment(tmp_path, "empty")
    name, path, _ = publish_segment(tmp_path)
    os.truncate(path, 100)
    with pytest.raises(SegmentError, match="truncated"):
        attach_segment(tmp_path, name)


@pytest.mark.parametrize("delta", [-1, -4096, +1, +4096])
def test_attach_refuses_size_mismatch(tmp_path, delta):
    meta = make_meta(rows=512, row_shape=(4,))  # 8 KiB of rows: truncation keeps the header
    name, path, _ = publish_segment(tmp_path, meta)
    os.truncate(path, meta.file_size + delta)
    with pytest.raises(SegmentError, match="bytes but its header describes"):
        attach_segment(tmp_path, name)


def test_attach_refuses_incomplete_segment(tmp_path):
    meta = make_meta()
    name = segment_name(NAMESPACE, meta, SECRET)
    writer = create_segment(tmp_path, temporary_name(NAMESPACE), meta)
    try:
        writer.data[...] = sample_data(meta)
        writer.set_progress(meta.rows)
        shutil.copyfile(writer.path, tmp_path / name)  # a final name with the complete flag still 0
        with pytest.raises(SegmentError, match="not complete"):
            attach_segment(tmp_path, name)
    finally:
        writer.abort()
    assert read_meta(tmp_path / name) == (meta, False)


def test_attach_refuses_other_format_version(tmp_path):
    name, path, _ = publish_segment(tmp_path)
    _patch(path, 8, struct.pack("<I", 1))  # a segment of the previous format
    with pytest.raises(SegmentError, match="segment format 1, this h5serve reads 2: .*restart the daemon"):
        attach_segment(tmp_path, name)


def test_attach_refuses_corrupt_metadata_length(tmp_path):
    name, path, _ = publish_segment(tmp_path)
    _patch(path, 32, struct.pack("<I", HEADER_SIZE))  # meta_len field
    with pytest.raises(SegmentError, match=f"corrupt header \\(metadata length {HEADER_SIZE}\\)"):
        attach_segment(tmp_path, name)


def test_attach_refuses_corrupt_metadata_bytes(tmp_path):
    name, path, _ = publish_segment(tmp_path)
    _patch(path, 64, b"\xc1")  # 0xc1 is never valid msgpack
    with pytest.raises(SegmentError, match="corrupt header"):
        attach_segment(tmp_path, name)


def _rewrite_meta(path, wire):
    blob = msgpack.packb(wire)
    _patch(path, 32, struct.pack("<I", len(blob)))
    _patch(path, 64, blob)


def test_attach_refuses_metadata_with_missing_field(tmp_path):
    meta = make_meta()
    name, path, _ = publish_segment(tmp_path, meta)
    wire = meta.to_wire()
    del wire["source_dtype"]
    _rewrite_meta(path, wire)
    with pytest.raises(SegmentError, match="missing or unknown"):
        attach_segment(tmp_path, name)


@pytest.mark.parametrize(
    "field, value",
    [("rows", "6"), ("rows", -1), ("source_dev", 1.5), ("world_size", True), ("key", 5), ("row_shape", [3, -4]),
     ("row_shape", [3, "4"])],
)
def test_attach_refuses_metadata_with_wrong_field_type(tmp_path, field, value):
    # regression: rows="6" used to pass from_wire and crash attach with TypeError in meta.file_size
    meta = make_meta()
    name, path, _ = publish_segment(tmp_path, meta)
    _rewrite_meta(path, {**meta.to_wire(), field: value})
    with pytest.raises(SegmentError, match="metadata"):
        attach_segment(tmp_path, name)
    with pytest.raises(SegmentError):
        SegmentMeta.from_wire({**meta.to_wire(), field: value})


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")
def test_attach_refuses_foreign_owner(tmp_path):
    name, path, _ = publish_segment(tmp_path)
    os.chown(path, 65534, 65534)
    with pytest.raises(SegmentError, match="belongs to uid 65534"):
        attach_segment(tmp_path, name)


# --------------------------------------------------------------------------- leases and eviction


def test_lease_blocks_eviction_until_close(tmp_path):
    name, path, _ = publish_segment(tmp_path)
    seg = attach_segment(tmp_path, name)
    try:
        assert try_evict(path) is False
        assert path.exists()
        assert try_evict(path) is False  # repeated attempts do not break the lease
        assert path.exists()
    finally:
        seg.close()
    assert try_evict(path) is True
    assert not path.exists()
    with pytest.raises(SegmentError):
        attach_segment(tmp_path, name)


def test_two_leases_both_block_eviction(tmp_path):
    name, path, _ = publish_segment(tmp_path)
    a = attach_segment(tmp_path, name)
    b = attach_segment(tmp_path, name)
    try:
        a.close()
        assert try_evict(path) is False
        assert path.exists()
    finally:
        a.close()
        b.close()
    assert try_evict(path) is True


def test_close_is_idempotent(tmp_path):
    name, path, _ = publish_segment(tmp_path)
    seg = attach_segment(tmp_path, name)
    seg.close()
    seg.close()
    assert try_evict(path)


def test_try_evict_missing_file_is_true(tmp_path):
    assert try_evict(tmp_path / "never-existed") is True


def test_try_evict_unleased_segment(tmp_path):
    name, path, _ = publish_segment(tmp_path)
    assert try_evict(path) is True
    assert os.listdir(tmp_path) == []


def test_mapping_survives_unlink(tmp_path):
    name, path, expected = publish_segment(tmp_path)
    seg = attach_segment(tmp_path, name)
    try:
        os.unlink(path)
        assert not path.exists()
        np.testing.assert_array_equal(seg.data, expected)
        assert float(seg.data.sum()) == float(expected.sum())
    finally:
        seg.close()


CHILD_ATTACH = """
    import hashlib, sys, time
    from pathlib import Path
    from h5serve.segments import attach_segment
    seg = attach_segment(Path(sys.argv[1]), sys.argv[2])
    print(hashlib.sha256(seg.data.tobytes()).hexdigest(), flush=True)
    time.sleep(60)  # holds the lease until the test kills it
"""


def test_child_process_lease_blocks_eviction_until_killed(tmp_path):
    import hashlib

    name, path, expected = publish_segment(tmp_path)
    proc = spawn_python(CHILD_ATTACH, tmp_path, name)
    try:
        digest = read_line(proc)
        assert digest == hashlib.sha256(expected.tobytes()).hexdigest()  # the child sees the same rows
        assert try_evict(path) is False
        assert path.exists()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=5)
        assert proc.returncode == -signal.SIGKILL
        # the kernel dropped the dead child's lock
        assert try_evict(path) is True
        assert not path.exists()
    finally:
        kill(proc)


CHILD_FSIZE = """
    import os, resource, signal, sys
    from pathlib import Path
    from h5serve.errors import ShmFull
    from h5serve.segments import SegmentMeta, create_segment
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    meta = SegmentMeta("/x.h5", 1, 2, 3, 4, "x", "contiguous", 1, 0, 4096, 4096, (1024,), "uint8", "uint8")
    try:
        create_segment(Path(sys.argv[1]), "seg.tmp-1-aaaaaa", meta)
    except ShmFull as exc:
        print("ShmFull", str(exc).replace("\\n", " "), flush=True)
    else:
        print("created", flush=True)
"""


def test_shm_full_when_file_size_limit_hit(tmp_path):
    """posix_fallocate failing with EFBIG (RLIMIT_FSIZE) is ShmFull, not a crash, and leaves no file."""
    proc = spawn_python(CHILD_FSIZE, tmp_path)
    try:
        line = read_line(proc)
        proc.wait(timeout=5)
    finally:
        kill(proc)
    assert line.startswith("ShmFull "), line
    assert "4.0 MiB" in line and "ulimit -f" in line
    assert proc.returncode == 0
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a small tmpfs")
def test_shm_full_on_small_tmpfs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount tmpfs: {res.stderr.decode(errors='replace').strip()}")
    try:
        meta = make_meta(rows=4096, row_shape=(1024,), dtype="uint8")  # 4 MiB + header
        with pytest.raises(ShmFull) as info:
            create_segment(mnt, temporary_name(segment_name(NAMESPACE, meta, SECRET)), meta)
        message = str(info.value)
        assert "needs" in message and "free" in message
        assert "4.0 MiB" in message
        assert str(mnt) in message
        assert isinstance(info.value, CapacityError)
        assert os.listdir(mnt) == []
        # a segment that fits is fine on the same mount
        small = make_meta(rows=16, row_shape=(1024,), dtype="uint8")
        name, path, expected = publish_segment(mnt, small)
        seg = attach_segment(mnt, name)
        try:
            np.testing.assert_array_equal(seg.data, expected)
        finally:
            seg.close()
        assert try_evict(path)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
