"""``h5serve demo``: why h5serve exists, measured in one run on this machine.

Two real ``torchrun`` jobs of ``nproc`` ranks each (DDP on gloo) over one sample file of a
few hundred MB, every rank's dataset in global mode (every row, reshuffled across the ranks
each epoch):

1. served by a real daemon that loads the file into ``/dev/shm`` (the ranks wait for it);
2. the same again: the ranks attach to what job 1 loaded and draw batches; then the same
   ranks do it the predecessor's way, no daemon involved: every rank preloads every row into
   its own memory (float32, as its ``RankMemCachedH5Dataset`` cast), then reads per item
   through h5py. (One job, not two: each torchrun start costs seconds of torch imports.)

The closing summary compares the time to a ready dataset, the node memory the ranks' data
takes, and the samples/s data loading alone can deliver. Everything lives in a temp dir that
is removed at the end; the daemon is stopped (killed, and its segments removed, if it does
not stop) and the jobs are killed, whatever happens.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from ..errors import ConfigError, H5ServeError
from ..util.progress import Progress
from ..util.units import format_bytes
from ..wire.runtime import resolve_shm_dir
from .daemon import DaemonProcess

__all__ = ["run_demo", "make_sample_file", "DemoResult", "DEFAULT_ROWS", "IMAGE_SHAPE"]

DEFAULT_ROWS = 100_000  # 307 MB of 3x32x32 uint8 images: big enough that the figures mean something
IMAGE_SHAPE = (3, 32, 32)
CHUNK_ROWS = 256
WRITE_BLOCK_ROWS = 8192  # rows written per h5py call (25 MB)
NOISE_ROWS = 4096  # one pool of random rows, reused shifted: drawing 300 MB of noise takes seconds
JOB_TIMEOUT_S = 300.0
POLL_S = 0.1
PREDECESSOR_ITEMSIZE = 4  # float32: the predecessor caches the cast rows


def make_sample_file(path: Path, rows: int, progress: Callable[[int], None] | None = None) -> int:
    """uint8 images whose mean encodes the label, int64 labels (a learnable toy problem),
    uncompressed, chunked by 256 rows. Returns the file's size in bytes."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, size=rows, dtype=np.int64)
    noise = rng.integers(0, 64, size=(NOISE_ROWS, *IMAGE_SHAPE), dtype=np.uint8)
    block = np.empty((min(WRITE_BLOCK_ROWS, max(rows, 1)), *IMAGE_SHAPE), dtype=np.uint8)
    with h5py.File(path, "w") as f:
        images = f.create_dataset("images", shape=(rows, *IMAGE_SHAPE), dtype=np.uint8,
                                  chunks=(min(CHUNK_ROWS, max(rows, 1)), *IMAGE_SHAPE))
        for start in range(0, rows, WRITE_BLOCK_ROWS):
            end = min(start + WRITE_BLOCK_ROWS, rows)
            pool = np.take(noise, np.arange(start, end) * 7 % NOISE_ROWS, axis=0)  # another mix each block
            np.add(pool, (labels[start:end] * 19).astype(np.uint8).reshape(-1, 1, 1, 1), out=block[: end - start])
            images[start:end] = block[: end - start]
            if progress is not None:
                progress(end)
        f.create_dataset("labels", data=labels)
    return path.stat().st_size


@dataclass(frozen=True)
class RankReport:
    """One rank's figures, as its ``rank<N>.json`` gives them (demo/train.py)."""

    rank: int
    backend: str
    rows: int
    ready_s: float
    samples_per_s: int | None  # None: not measured in this job
    pss_growth: int
    loss: float | None


@dataclass(frozen=True)
class DemoResult:
    """What one run measured: every job's ranks, and the daemon's segments (bytes, once)."""

    load: list[RankReport]  # job 1
    attach: list[RankReport]  # job 2, the h5serve dataset
    predecessor: list[RankReport]  # job 2, the predecessor's way
    segment_bytes: int

    @staticmethod
    def _ready(job: list[RankReport]) -> float:
        return max(r.ready_s for r in job)  # a job is ready when its last rank is

    @staticmethod
    def _rate(job: list[RankReport]) -> int:
        return sum(r.samples_per_s or 0 for r in job)  # the ranks draw at the same time

    def summary(self) -> list[str]:
        """The three closing lines, each with its ratio."""
        n = len(self.load)
        load, attach, preload = (self._ready(j) for j in (self.load, self.attach, self.predecessor))
        shm_mem = self.segment_bytes + sum(max(r.pss_growth, 0) for r in self.attach)
        pre_mem = sum(max(r.pss_growth, 0) for r in self.predecessor)
        shm_rate, lazy_rate = self._rate(self.attach), self._rate(self.predecessor)
        return [
            f"ready:       first job {load:.2f} s (the daemon loads the file), second job {attach * 1000:.1f} ms "
            f"(attaches), predecessor preload {preload:.2f} s: attach {preload / max(attach, 1e-6):,.0f}x faster, "
            f"first load {preload / max(load, 1e-6):.1f}x",
            f"node memory: {format_bytes(shm_mem)} (one uint8 copy in /dev/shm shared by {n} ranks) vs "
            f"{format_bytes(pre_mem)} (a float32 copy in each rank): {pre_mem / max(shm_mem, 1):.1f}x less "
            "(PSS growth of the ranks + the segments, page cache not counted)",
            f"data rate:   {shm_rate:,} samples/s from shared memory vs {lazy_rate:,} from the predecessor's lazy "
            f"per-item h5py reads: {shm_rate / max(lazy_rate, 1):,.0f}x ({n} ranks at once, data loading alone: "
            "no model, batch 256, shuffled, num_workers=0)",
        ]


def _table(title: str, job: list[RankReport]) -> str:
    lines = [title, f"  {'rank':>4} {'backend':>11} {'rows':>8} {'ready ms':>9} {'samples/s':>10} "
                    f"{'PSS growth':>11} {'loss':>7}"]
    for r in job:
        loss = "-" if r.loss is None else f"{r.loss:.3f}"
        rate = "-" if r.samples_per_s is None else f"{r.samples_per_s:,}"
        lines.append(f"  {r.rank:>4} {r.backend:>11} {r.rows:>8} {r.ready_s * 1000:>9.1f} {rate:>10} "
                     f"{format_bytes(r.pss_growth):>11} {loss:>7}")
    return "\n".join(lines)


class _LoadWatch:
    """Shows the daemon's load as a progress bar (rows of both arrays), polled while job 1 runs;
    the bar starts once the ranks have asked for the load."""

    def __init__(self, runtime_dir: Path, total: int, emit: Callable[[str], None]) -> None:
        from ..wire.connection import DaemonClient

        self.client = DaemonClient(runtime_dir, timeout=2.0)
        self.total, self.emit = total, emit
        self.bar: Progress | None = None
        self.done = False

    def poll(self) -> None:
        if self.done:
            return
        try:
            segments = self.client.status()["segments"]
        except H5ServeError:
            return
        if not segments:
            return
        if self.bar is None:
            self.bar = Progress("loading into /dev/shm", self.total, self.emit, interval=1.0)
        self.bar.update(sum(s["rows_done"] if s["state"] == "loading" else s["rows"] for s in segments))
        if len(segments) >= 2 and all(s["state"] != "loading" for s in segments):
            self.close()

    def close(self) -> None:
        self.done = True
        if self.bar is not None:
            self.bar.close()
        self.client.close()


class _Demo:
    """The run's temp dir, daemon and jobs; ``close`` undoes all of it."""

    def __init__(self, rows: int, nproc: int, seconds: float, steps: int) -> None:
        self.rows, self.nproc, self.seconds, self.steps = rows, nproc, seconds, steps
        self.workdir = Path(tempfile.mkdtemp(prefix="h5serve-demo-"))
        self.runtime_dir = self.workdir / "rt"
        scratch = self.workdir / "tmp"  # torch's own temp dirs (torchelastic_*, ...) go there, and go with it
        scratch.mkdir()
        self.env = {**os.environ, "H5SERVE_RUNTIME_DIR": str(self.runtime_dir), "OMP_NUM_THREADS": "1",
                    "TMPDIR": str(scratch)}
        self.path = self.workdir / "train.h5"
        self.job: subprocess.Popen[bytes] | None = None
        self.watch: _LoadWatch | None = None
        self.daemon = DaemonProcess(self.workdir, ("--keep-page-cache",), self.env)

    def say(self, line: str) -> None:
        print(line, flush=True)

    def make_file(self) -> None:
        bar = Progress("making the sample file", self.rows, self.say, interval=1.0)
        try:
            size = make_sample_file(self.path, self.rows, bar.update)
        finally:
            bar.close()
        self.say(f"sample file: {self.path} ({format_bytes(size)}: {self.rows} rows of "
                 f"{'x'.join(map(str, IMAGE_SHAPE))} uint8 images + int64 labels, uncompressed)")

    def start_daemon(self) -> None:
        # --keep-page-cache: the file stays in the page cache, so every job reads it from memory alike
        self.say(self.daemon.start().start_output.strip())

    def stop_daemon(self) -> None:
        """Stop the daemon; if it does not stop, kill it and remove what it left in shm."""
        self.daemon.stop()

    def segment_bytes(self) -> int:
        from ..wire.connection import DaemonClient

        with DaemonClient(self.runtime_dir) as client:
            return int(client.status()["memory"]["used"])

    def run_job(self, kind: str, poll: Callable[[], None] | None = None) -> dict[str, list[RankReport]]:
        """Run one torchrun job; its ranks' reports by name (``rank``, ``predecessor``)."""
        report_dir = Path(tempfile.mkdtemp(prefix="reports-", dir=self.workdir))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.nproc}",
               "-m", "h5serve.demo.train", str(self.path), "--kind", kind, "--seconds", str(self.seconds),
               "--steps", str(self.steps), "--report-dir", str(report_dir)]
        out = open(report_dir / "output.txt", "w+b")
        try:
            self.job = subprocess.Popen(cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                        # a group of its own: killed whole below
                                        cwd=self.workdir, start_new_session=True)
            deadline = time.monotonic() + JOB_TIMEOUT_S
            while self.job.poll() is None:
                if time.monotonic() > deadline:
                    raise H5ServeError(f"the demo's {kind} job did not finish within {JOB_TIMEOUT_S:.0f}s")
                if poll is not None:
                    poll()
                time.sleep(POLL_S)
            if poll is not None:
                poll()
            if self.job.returncode != 0:
                out.seek(0)
                raise H5ServeError(f"the demo's {kind} job failed (exit {self.job.returncode}):\n"
                                   + out.read()[-4000:].decode(errors="replace"))
        finally:
            out.close()
            self.kill_job()
        found: dict[str, list[RankReport]] = {}
        for name in ("rank", "predecessor"):
            reports = [RankReport(**json.loads(p.read_text())) for p in report_dir.glob(f"{name}*.json")]
            if reports:
                found[name] = sorted(reports, key=lambda r: r.rank)
        expected = ["rank", "predecessor"] if kind == "compare" else ["rank"]
        if any(len(found.get(name, [])) != self.nproc for name in expected):
            raise H5ServeError(f"the demo's {kind} job ended without every rank's report")
        return found

    def kill_job(self) -> None:
        if self.job is not None and self.job.poll() is None:
            try:
                os.killpg(self.job.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.job.wait()
        self.job = None

    def close(self) -> None:
        try:
            self.kill_job()
            if self.watch is not None:
                self.watch.close()
            self.stop_daemon()
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _check_room(rows: int, nproc: int) -> None:
    """Raised when this machine has not the memory the demo takes: ConfigError."""
    data = rows * int(np.prod(IMAGE_SHAPE))
    need = data + nproc * data * PREDECESSOR_ITEMSIZE  # the segment, then every rank's float32 copy
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return
    st = os.statvfs(resolve_shm_dir())
    if data > st.f_bavail * st.f_frsize or need > available:
        raise ConfigError(
            f"the demo with --rows {rows} and --nproc {nproc} needs {format_bytes(data)} free in "
            f"{resolve_shm_dir()} and {format_bytes(need)} of memory ({format_bytes(available)} available); "
            "pass a smaller --rows"
        )


def run_demo(rows: int = DEFAULT_ROWS, nproc: int = 2, seconds: float = 2.0, steps: int = 20) -> int:
    _check_room(rows, nproc)
    started = time.monotonic()
    demo = _Demo(rows, nproc, seconds, steps)
    try:
        demo.make_file()
        demo.start_daemon()
        demo.watch = _LoadWatch(demo.runtime_dir, 2 * rows, demo.say)
        load = demo.run_job("load", demo.watch.poll)["rank"]
        demo.watch.close()
        demo.say(_table(f"job 1, daemon running: the ranks wait while it loads the file into /dev/shm once, then "
                        f"train {steps} DDP steps:", load))
        second = demo.run_job("compare")
        attach, predecessor = second["rank"], second["predecessor"]
        demo.say(_table(f"job 2, same daemon: the ranks attach to what job 1 loaded, draw batches for {seconds:g} s, "
                        f"train {steps} steps:", attach))
        demo.say(_table(f"  then the same ranks the predecessor's way (no daemon involved): each preloads every row "
                        f"as float32, then reads per item through h5py for {seconds:g} s:", predecessor))
        segment_bytes = demo.segment_bytes()
        result = DemoResult(load, attach, predecessor, segment_bytes)
        demo.say(f"\nmeasured in this run ({time.monotonic() - started:.0f} s, {nproc} ranks, every row on every "
                 "rank, the file in the page cache for every job):")
        for line in result.summary():
            demo.say(line)
        return 0
    finally:
        demo.close()
