"""One rank of tests/cluster/test_slurm.py's jobs, launched by srun (one task per rank) or by
torchrun (one per node): opens ARGV[1] with SharedH5Dataset (contiguous, fallback ``error``
unless $FALLBACK says otherwise), reads every row of its shard, checks each against h5py, and
writes ``ARGV[2]/rank<N>.json``: rank, host, uid, backend, rows read, rows that differed, the
runtime dir the TaskProlog gave it and how long opening took. ``--hold FILE`` waits (up to 120 s)
for FILE after opening, for tests that act while a job runs; ``--start-after FILE`` waits (up to
120 s) for FILE before opening, for tests that prepare the node first. AUTO_STREAM=0 passes
auto_stream=False (no room: lazy reads, never stream mode)."""

import json
import os
import socket
import sys
import time

import h5py
import numpy as np

from h5serve.client import SharedH5Dataset


def main() -> None:
    path, out = sys.argv[1], sys.argv[2]
    hold = sys.argv[sys.argv.index("--hold") + 1] if "--hold" in sys.argv else ""
    start_after = sys.argv[sys.argv.index("--start-after") + 1] if "--start-after" in sys.argv else ""
    if start_after:
        wait_for_file(start_after)
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    started = time.monotonic()
    ds = SharedH5Dataset(path, x_key="x", y_key="y", mode="contiguous", fallback=os.environ.get("FALLBACK", "error"),
                         auto_stream=os.environ.get("AUTO_STREAM", "1") != "0")
    opened = time.monotonic() - started
    with h5py.File(path) as f:
        x_all = f["x"][:]
    rows, differed = [], 0
    for i in range(len(ds.indices)):
        x, y = ds[i]
        differed += not np.array_equal(np.asarray(x), x_all[int(y)])
        rows.append(int(y))
    report = {"rank": rank, "host": socket.gethostname(), "uid": os.getuid(), "backend": ds.backend, "rows": rows,
              "differed": differed, "runtime_dir": os.environ.get("H5SERVE_RUNTIME_DIR", ""), "open_s": opened}
    # whole or not there: tests poll for the reports while the job holds (a reader saw an empty file)
    partial = os.path.join(out, f".rank{rank}.json.{os.getpid()}")
    with open(partial, "w") as f:
        json.dump(report, f)
    os.replace(partial, os.path.join(out, f"rank{rank}.json"))
    if hold:
        wait_for_file(hold)
    ds.close()


def wait_for_file(path: str) -> None:
    deadline = time.monotonic() + 120
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.1)


if __name__ == "__main__":
    main()
