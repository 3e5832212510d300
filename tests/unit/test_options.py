"""SharedH5Dataset's option groups (client/options.py): ``stream=StreamOptions(...)``,
``place=NodePlace(...)`` and ``daemon=DaemonOptions(...)`` give the dataset the loose keywords
give (the same rows in the same order, the same block layout and window, the same daemon
settings), a group with one of its own keywords is refused naming both, and the objects are
frozen and check their fields. No daemon runs: every dataset reads lazily."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5serve.client import DaemonOptions, NodePlace, SharedH5Dataset, StreamOptions, collate
from h5serve.errors import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore:h5serve. no h5serve daemon:RuntimeWarning")


@pytest.fixture
def h5file(tmp_path: Path) -> str:
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.arange(1000 * 4, dtype=np.float32).reshape(1000, 4), chunks=(16, 4))
        f.create_dataset("y", data=np.arange(1000, dtype=np.int64), chunks=(16,))
    return str(path)


def _pair(h5file: str, loose: dict[str, object], grouped: dict[str, object]) -> tuple[SharedH5Dataset, ...]:
    return (SharedH5Dataset(h5file, "x", "y", **loose),  # type: ignore[arg-type]
            SharedH5Dataset(h5file, "x", "y", **grouped))  # type: ignore[arg-type]


def test_stream_place_and_daemon_groups_make_the_dataset_the_loose_keywords_make(h5file: str, tmp_path: Path) -> None:
    none = tmp_path / "none"
    loose = _pair(h5file,
                  dict(mode="stream", window="64KiB", block_rows=48, local_rank=1, local_world_size=2, node_rank=1,
                       num_nodes=2, runtime_dir=none, timeout=2.0, daemon_user=0, wait_ready=False),
                  dict(mode="stream", stream=StreamOptions(window="64KiB", block_rows=48),
                       place=NodePlace(local_rank=1, local_world_size=2, node_rank=1, num_nodes=2),
                       daemon=DaemonOptions(runtime_dir=none, timeout=2.0, daemon_user=0, wait_ready=False)))
    a, b = loose
    try:
        assert a.stream is not None and b.stream is not None
        assert a.stream.config == b.stream.config and a.stream.config.layout.block_rows == 48
        assert a.stream.config.window_bytes == 64 * 1024
        assert (a.rank, a.world_size, a.layout) == (b.rank, b.world_size, b.layout) and a.rank == 3
        assert a.spec == b.spec and a.spec.timeout == 2.0 and a.spec.runtime_dir == str(none)
        assert (a.fallback, a._wait_ready) == (b.fallback, b._wait_ready) == ("lazy", False)
        np.testing.assert_array_equal(a.indices, b.indices)
        assert a.shard_sizes() == b.shard_sizes()
        x_a, y_a = collate(a.__getitems__(np.arange(len(a))))
        x_b, y_b = collate(b.__getitems__(np.arange(len(b))))
        assert (x_a == x_b).all() and (y_a == y_b).all()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("mode", ["node", "contiguous", "global"])
def test_the_groups_give_the_same_rows_in_other_modes(h5file: str, tmp_path: Path, mode: str) -> None:
    place = dict(local_rank=0, local_world_size=2, node_rank=1, num_nodes=3) if mode == "node" else {}
    a, b = _pair(h5file,
                 dict(mode=mode, runtime_dir=tmp_path / "none", auto_stream=False, fallback="lazy", **place),
                 dict(mode=mode, stream=StreamOptions(auto_stream=False),
                      daemon=DaemonOptions(runtime_dir=tmp_path / "none"),
                      **({"place": NodePlace(**place)} if place else {})))  # type: ignore[arg-type]
    try:
        assert a.auto_stream is b.auto_stream is False and a.spec == b.spec and a.layout == b.layout
        np.testing.assert_array_equal(a.indices, b.indices)
        assert len(a.indices) == (1000 if mode != "node" else 334)  # node 1 of 3: ranks 2 and 3's shards of 6
        assert a.shard_sizes() == b.shard_sizes()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(("group", "loose", "named"), [
    ({"stream": StreamOptions(window="1MiB")}, {"window": "1MiB"}, "window='1MiB'"),
    ({"stream": StreamOptions()}, {"auto_stream": False}, "auto_stream=False"),
    ({"place": NodePlace(0, 1, 0, 1)}, {"num_nodes": 1}, "num_nodes=1"),
    ({"daemon": DaemonOptions()}, {"fallback": "error"}, "fallback='error'"),
    ({"daemon": DaemonOptions(timeout=3)}, {"runtime_dir": "/nowhere", "wait_ready": True},
     "runtime_dir='/nowhere', wait_ready=True"),
])
def test_a_group_with_one_of_its_own_keywords_is_refused_naming_both(
        h5file: str, group: dict[str, object], loose: dict[str, object], named: str) -> None:
    (name, value), = group.items()
    with pytest.raises(ConfigError, match=f"{name}=.*{named}") as caught:
        SharedH5Dataset(h5file, "x", "y", mode="stream", **group, **loose)  # type: ignore[arg-type]
    assert repr(value) in str(caught.value)


def test_a_group_of_the_wrong_kind_or_outside_its_mode_is_refused(h5file: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="stream= takes a StreamOptions, got DaemonOptions"):
        SharedH5Dataset(h5file, "x", mode="stream", stream=DaemonOptions())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="place= takes a NodePlace"):
        SharedH5Dataset(h5file, "x", mode="node", place=(0, 1, 0, 1))  # type: ignore[arg-type]
    # the loose keywords' own rules hold for the values of a group
    with pytest.raises(ConfigError, match="window and block_rows are for mode='stream' only"):
        SharedH5Dataset(h5file, "x", mode="global", stream=StreamOptions(window="1MiB"))
    with pytest.raises(ConfigError, match=r"num_nodes \(place=\) describe the node for mode='node' only"):
        SharedH5Dataset(h5file, "x", mode="global", place=NodePlace(0, 1, 0, 1))
    with pytest.raises(ConfigError, match="block_rows=40 is not a whole number of chunks"):
        SharedH5Dataset(h5file, "x", mode="stream", stream=StreamOptions(window="1MiB", block_rows=40),
                        daemon=DaemonOptions(runtime_dir=tmp_path / "none"))


def test_the_options_are_frozen() -> None:
    for options in (StreamOptions(), DaemonOptions(), NodePlace(0, 1, 0, 1)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(options, dataclasses.fields(options)[0].name, 1)
    assert StreamOptions(window="2GiB") == StreamOptions(window="2GiB")
    assert hash(DaemonOptions(timeout=1)) == hash(DaemonOptions(timeout=1))  # one object, reusable as a key


@pytest.mark.parametrize(("make", "message"), [
    (lambda: StreamOptions(window="lots"), r"window='lots' is not a size"),
    (lambda: StreamOptions(window=0), r"window must be more than 0 bytes"),
    (lambda: StreamOptions(block_rows=0), r"block_rows must be"),
    (lambda: StreamOptions(block_rows=2.5), r"block_rows must be"),
    (lambda: StreamOptions(auto_stream="yes"), r"auto_stream must be True or False, got 'yes'"),
    (lambda: DaemonOptions(fallback="never"), r"fallback must be one of \('lazy', 'error'\), got 'never'"),
    (lambda: DaemonOptions(timeout=0), r"timeout must be a number of seconds > 0"),
    (lambda: DaemonOptions(timeout="5"), r"timeout must be a number of seconds > 0"),
    (lambda: DaemonOptions(daemon_user=-1), r"daemon_user must be a user name, a uid >= 0 or None, got -1"),
    (lambda: DaemonOptions(daemon_user=""), r"daemon_user must be"),
    (lambda: DaemonOptions(wait_ready="no"), r"wait_ready must be None, True or False"),
    (lambda: DaemonOptions(runtime_dir=5), r"runtime_dir must be a path"),
    (lambda: NodePlace(2, 2, 0, 1), r"local_rank must be in \[0, 1\], got 2"),
    (lambda: NodePlace(0, 1, 0, 0), r"num_nodes must be an integer >= 1"),
])
def test_the_options_check_their_fields(make: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make()  # type: ignore[operator]


def test_each_field_has_the_default_and_type_of_the_keyword_it_stands_for() -> None:
    params = inspect.signature(SharedH5Dataset.__init__).parameters
    for kind in (StreamOptions, DaemonOptions, NodePlace):
        for field in dataclasses.fields(kind):
            param = params[field.name]
            default = None if field.default is dataclasses.MISSING else field.default
            assert param.default == default, field.name
            if kind is not NodePlace:  # NodePlace's fields are required ints, the loose keywords optional
                assert param.annotation == field.type, field.name
    for name, kind in (("stream", StreamOptions), ("place", NodePlace), ("daemon", DaemonOptions)):
        assert params[name].default is None and params[name].annotation == f"{kind.__name__} | None"
