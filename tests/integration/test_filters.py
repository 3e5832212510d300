"""Third-party compression filters (the `filters` extra, hdf5plugin): served by the daemon and
the lazy path when installed; a clear error naming the filter and the extra when not."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import h5py
import hdf5plugin
import numpy as np
import pytest

from h5serve.client import SharedH5Dataset, collate

from ..helpers import Daemon

FILTERS = {
    "blosc": lambda: hdf5plugin.Blosc(cname="lz4", clevel=5, shuffle=hdf5plugin.Blosc.SHUFFLE),
    "zstd": lambda: hdf5plugin.Zstd(clevel=3),
    "lz4": lambda: hdf5plugin.LZ4(),
    "bitshuffle": lambda: hdf5plugin.Bitshuffle(cname="lz4"),
}


@pytest.fixture(scope="module")
def compressed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    path = tmp_path_factory.mktemp("filters") / "compressed.h5"
    rng = np.random.default_rng(1)
    data = (rng.integers(0, 16, size=(999, 3, 8, 8)) * 7).astype(np.uint16)
    with h5py.File(path, "w") as f:
        for name, make in FILTERS.items():
            f.create_dataset(name, data=data, chunks=(64, 3, 8, 8), **make())
    return path, data


@pytest.mark.parametrize("name", list(FILTERS))
@pytest.mark.parametrize("backend", ["shm", "lazy"])
def test_compressed_datasets_are_served(compressed, shared_daemon: Daemon, no_daemon_env: Path, name: str,
                                        backend: str) -> None:
    path, data = compressed
    kwargs = {"runtime_dir": shared_daemon.runtime_dir, "fallback": "error"} if backend == "shm" else {}
    with pytest.warns(RuntimeWarning) if backend == "lazy" else contextlib.nullcontext():
        ds = SharedH5Dataset(path, name, mode="interleave", rank=1, world_size=2, **kwargs)
    assert ds.backend == backend
    got = collate(ds.__getitems__(list(range(len(ds)))))
    assert got.numpy().tobytes() == data[1::2].tobytes()


def test_without_the_extra_the_error_names_filter_and_extra(compressed, tmp_path: Path) -> None:
    path, _ = compressed
    script = (
        "import sys, json\n"
        "sys.modules['hdf5plugin'] = None  # as if the filters extra were not installed\n"
        "from h5serve.client import SharedH5Dataset\n"
        "from h5serve.errors import UnsupportedDataset\n"
        "out = {}\n"
        "for name in ('blosc', 'zstd'):\n"
        "    try:\n"
        f"        SharedH5Dataset({str(path)!r}, name)\n"
        "        out[name] = 'served'\n"
        "    except UnsupportedDataset as exc:\n"
        "        out[name] = str(exc)\n"
        "print(json.dumps(out))\n"
    )
    env_dir = tmp_path / "none"
    env_dir.mkdir(mode=0o700)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={"H5SERVE_RUNTIME_DIR": str(env_dir), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "'blosc' (id 32001)" in out["blosc"] and "pip install 'h5serve[filters]'" in out["blosc"]
    assert "'zstd' (id 32015)" in out["zstd"] and "h5serve[filters]" in out["zstd"]
