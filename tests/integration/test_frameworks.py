"""h5serve under the frameworks people train with (issue 10): PyTorch Lightning
(``Trainer(accelerator="cpu", devices=2, strategy="ddp")``, Lightning's own launcher) and
Hugging Face Accelerate (``accelerate launch``, 2 processes), both gloo on CPU, against a real
daemon and once without one (lazy h5py reads of the same rows).

Each framework's job runs once per module, both at the same time (start-up is slow: Lightning's
import alone takes ~10 s here); its script (tests/jobs/lightning_job.py, tests/jobs/accelerate_job.py)
trains a tiny model for 2 epochs per case and writes the labels (= row ids) every rank saw in
every batch.

255 rows in batches of 32 make every correct setup yield 128 samples per rank per epoch: one
row repeated (DistributedSampler's, make_loader's and Accelerate's padding alike), four full
batches per rank. Four full batches are also what lets a second sharding go unnoticed: a batch
sampler that keeps every other batch of an already sharded epoch ends without error.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..helpers import Daemon, make_h5, short_tmpdir

pytestmark = pytest.mark.slow

ROWS, BATCH, EPOCHS = 255, 32, 2
PADDED = 128  # samples per rank per epoch: ceil(255 / 2), every correct setup alike
JOBS = Path(__file__).resolve().parent.parent / "jobs"  # the torchrun and launcher scripts
SHARDED = ("contiguous", "interleave", "node")
MODES = ("global", *SHARDED)
LENGTHS = {"global": [ROWS, ROWS], "contiguous": [128, 127], "interleave": [128, 127], "node": [ROWS, ROWS]}

# --------------------------------------------------------------------------- running the jobs


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_h5(tmp_path_factory.mktemp("frameworks") / "train.h5", rows=ROWS)


@pytest.fixture(scope="module")
def empty_runtime_dir() -> Iterator[Path]:
    """A runtime dir where no daemon runs: the jobs' ``lazy`` cases read through h5py."""
    empty = short_tmpdir("h5s-none-")
    yield empty
    shutil.rmtree(empty, ignore_errors=True)


class Job:
    """One framework's job (its command starts both ranks), in its own session, output to a
    file; ``results`` waits for it, and ``kill`` ends it with everything it started."""

    def __init__(self, cmd: list[str], out: Path, runtime_dir: Path) -> None:
        out.mkdir()
        self.out = out
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                            "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED")}
        env.update(H5SERVE_RUNTIME_DIR=str(runtime_dir), OMP_NUM_THREADS="1", PYTHONPATH=str(JOBS.parent.parent))
        with open(out / "output.txt", "w") as log:
            self.process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def results(self, deadline: float) -> dict[str, list[dict]]:
        """Per case, the two ranks' results (rank 0 first)."""
        try:
            self.process.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"killed after {deadline} s (a rank waiting in a collective?): "
                        f"{(self.out / 'output.txt').read_text()[-6000:]}")
        assert self.process.returncode == 0, (self.out / "output.txt").read_text()[-6000:]
        reports = [json.loads((self.out / f"rank{r}.json").read_text()) for r in range(2)]
        return {case: [reports[0][case], reports[1][case]] for case in reports[0]}

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


LIGHTNING_CASES = [
    "global:plain:lightning",  # Lightning's DistributedSampler over the whole file
    *(f"{mode}:make:own" for mode in MODES),  # use_distributed_sampler=False, make_loader
    *(f"{mode}:make:lightning" for mode in MODES),  # the default, with make_loader
    *(f"{mode}:plain:lightning" for mode in SHARDED),  # the default, a plain DataLoader over a shard
    "contiguous:epoch:lightning",  # the default, DataLoader(sampler=EpochShuffleSampler) over a shard
    "global:plain:lightning:lazy", "interleave:make:own:lazy", "node:make:own:lazy",
]

ACCELERATE_CASES = [
    "global:plain:prepare",  # a plain DataLoader through accelerator.prepare
    *(f"{mode}:make:own" for mode in MODES),  # make_loader, not prepared
    *(f"{mode}:make:prepare" for mode in MODES),  # make_loader through prepare
    "contiguous:plain:prepare", "interleave:plain:prepare",  # a plain DataLoader over a shard, prepared
    "contiguous:epoch:prepare",  # DataLoader(sampler=EpochShuffleSampler) over a shard, prepared
    "global:plain:prepare:lazy", "contiguous:make:own:lazy", "node:make:own:lazy",
]


@pytest.fixture(scope="module")
def jobs(shared_daemon: Daemon, data_file: Path, empty_runtime_dir: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Job]]:
    """Both frameworks' jobs, started together: Lightning's first rank imports alone for
    seconds before it starts the second, time the Accelerate job uses."""
    common = ["--batch-size", str(BATCH), "--epochs", str(EPOCHS), "--lazy-runtime-dir", str(empty_runtime_dir)]
    started: dict[str, Job] = {}
    try:
        if importlib.util.find_spec("lightning") is not None:
            out = tmp_path_factory.mktemp("lightning") / "out"
            started["lightning"] = Job([sys.executable, str(JOBS / "lightning_job.py"), str(data_file), str(out),
                                        "--cases", ",".join(LIGHTNING_CASES), *common], out, shared_daemon.runtime_dir)
        if importlib.util.find_spec("accelerate") is not None:
            out = tmp_path_factory.mktemp("accelerate") / "out"
            # --multi_gpu is accelerate's torchrun launcher (the job asks for Accelerator(cpu=True));
            # "--cpu --num_processes 2" starts a single process unless MPI is set up.
            started["accelerate"] = Job(
                [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                 "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                 str(JOBS / "accelerate_job.py"), str(data_file), str(out), "--cases", ",".join(ACCELERATE_CASES),
                 "--collective-timeout", "60", *common], out, shared_daemon.runtime_dir)
        yield started
    finally:
        for job in started.values():
            job.kill()


@pytest.fixture(scope="module")
def lightning(jobs: dict[str, Job]) -> dict[str, list[dict]]:
    if "lightning" not in jobs:
        pytest.importorskip("lightning")
    return jobs["lightning"].results(deadline=200)


@pytest.fixture(scope="module")
def accelerate(jobs: dict[str, Job]) -> dict[str, list[dict]]:
    if "accelerate" not in jobs:
        pytest.importorskip("accelerate")
    return jobs["accelerate"].results(deadline=200)


# --------------------------------------------------------------------------- what a run must show


def rows_of(run: list[dict], epoch: int) -> list[int]:
    return [row for rank in run for batch in rank["epochs"][epoch] for row in batch]


def assert_every_row_once(run: list[dict], backend: str = "shm") -> None:
    """Both ranks trained; each epoch every row came once across them (one padded repeat, as
    DistributedSampler pads 255 rows to 2 x 128), in the same batch sizes on both ranks, and
    the second epoch was reshuffled."""
    failed = [rank for rank in run if "error" in rank]
    assert not failed, f"the job raised: {failed[0]}"
    assert [rank["backend"] for rank in run] == [backend, backend]
    for epoch in range(EPOCHS):
        counts = Counter(rows_of(run, epoch))
        missing = sorted(set(range(ROWS)) - set(counts))
        assert not missing, (f"epoch {epoch}: {len(missing)} of {ROWS} rows never seen (sharded twice?), "
                             f"e.g. {missing[:8]}")
        assert sum(counts.values()) == 2 * PADDED and len(counts) == ROWS  # every row once, one repeat
        sizes = [[len(batch) for batch in rank["epochs"][epoch]] for rank in run]
        assert sizes[0] == sizes[1] == [BATCH] * (PADDED // BATCH), sizes  # equal batches: no DDP hang
    for rank in run:
        assert rank["epochs"][0] != rank["epochs"][1]  # set_epoch reshuffled


def assert_correct_or_refused(run: list[dict], fix: str) -> None:
    """Never a silent double sharding: either every row once per epoch, or an h5serve
    ConfigError on both ranks whose message names the fix."""
    if not any("error" in rank for rank in run):
        assert_every_row_once(run)
        return
    for rank in run:
        assert rank.get("error") == "ConfigError" and rank.get("h5serve"), (
            f"not an h5serve ConfigError: {rank.get('module')}.{rank.get('error')}: {rank.get('message')}")
        assert fix in rank["message"], rank["message"]


# --------------------------------------------------------------------------- PyTorch Lightning


@pytest.mark.timeout(240)
def test_lightning_global_mode_with_lightnings_sampler_covers_every_row_once(lightning: dict) -> None:
    """mode="global", DataLoader(ds, batch_size, shuffle=True), Trainer defaults: Lightning
    swaps in its DistributedSampler (and calls its set_epoch): every row once per epoch."""
    run = lightning["global:plain:lightning"]
    assert_every_row_once(run)
    assert [rank["len"] for rank in run] == LENGTHS["global"] and [rank["rank"] for rank in run] == [0, 1]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", MODES)
def test_lightning_make_loader_without_lightnings_sampler_covers_every_row_once(lightning: dict, mode: str) -> None:
    """Trainer(use_distributed_sampler=False), make_loader, the dataset opened in the
    DataModule's setup(), no set_epoch of our own (Lightning reaches it): each rank its shard
    (node: the node's rows dealt), every row once per epoch, equal batches on both ranks."""
    run = lightning[f"{mode}:make:own"]
    assert_every_row_once(run)
    assert [rank["len"] for rank in run] == LENGTHS[mode]
    assert [(rank["rank"], rank["world_size"]) for rank in run] == [(0, 2), (1, 2)]


# With use_distributed_sampler=True Lightning rebuilds make_loader's batch sampler as
# type(bs)(DistributedSampler(ds), batch_size=..., drop_last=...) (lightning/fabric/utilities/
# data.py, _dataloader_init_kwargs_resolve_sampler). Before h5serve checked for it the three
# samplers failed with messages that did not name the fix (one a builtins TypeError).
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", MODES)
def test_lightning_default_sampler_with_make_loader_never_double_shards(lightning: dict, mode: str) -> None:
    assert_correct_or_refused(lightning[f"{mode}:make:lightning"], fix="use_distributed_sampler=False")


# With the defaults Lightning would shard a DataLoader of your own over a contiguous or
# interleave shard a second time, silently: each rank would see half of its shard. "plain"
# (shuffle=True) gets DistributedSampler(ds): caught by SharedH5Dataset.__len__ refusing to be
# measured by a DistributedSampler (the one check on the caller's frame: resharding.py says why).
# "epoch" (sampler=EpochShuffleSampler) gets DistributedSamplerWrapper, whose
# _DatasetSamplerWrapper iterates the EpochShuffleSampler: caught by the sampler's __iter__.
# (node on one node holds every row, so there it works.)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", [*(f"{mode}:plain" for mode in SHARDED), "contiguous:epoch"])
def test_lightning_default_sampler_with_own_loader_on_a_shard_never_double_shards(lightning: dict,
                                                                                 case: str) -> None:
    assert_correct_or_refused(lightning[f"{case}:lightning"], fix="use_distributed_sampler=False")


@pytest.mark.timeout(240)
def test_lightning_without_a_daemon_reads_the_same_rows_lazily(lightning: dict) -> None:
    for case in ("global:plain:lightning", "interleave:make:own", "node:make:own"):
        lazy = lightning[f"{case}:lazy"]
        assert_every_row_once(lazy, backend="lazy")
        assert [rank["epochs"] for rank in lazy] == [rank["epochs"] for rank in lightning[case]]  # batch for batch


# --------------------------------------------------------------------------- Hugging Face Accelerate


@pytest.mark.timeout(240)
def test_accelerate_global_mode_through_prepare_covers_every_row_once(accelerate: dict) -> None:
    """mode="global", DataLoader(ds, batch_size, shuffle=True) through accelerator.prepare:
    Accelerate deals the batches of one shuffled order (its generator synchronised from rank
    0) to the ranks, padding the last one from the epoch's start (even_batches)."""
    run = accelerate["global:plain:prepare"]
    assert_every_row_once(run)
    assert [rank["len"] for rank in run] == LENGTHS["global"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", MODES)
def test_accelerate_make_loader_not_prepared_covers_every_row_once(accelerate: dict, mode: str) -> None:
    """model, optimizer = accelerator.prepare(model, optimizer); the make_loader loader is
    used as it is, with batch_sampler.set_epoch(epoch): every row once per epoch."""
    run = accelerate[f"{mode}:make:own"]
    assert_every_row_once(run)
    assert [rank["len"] for rank in run] == LENGTHS[mode]


# accelerator.prepare wraps make_loader's batch sampler in BatchSamplerShard, which keeps every other batch of the
# rank's already sharded epoch: with these sizes (4 full batches per rank) each rank would
# train on 2, half the rows per epoch, silently in every mode. With a short last batch it failed,
# at the end of the first epoch, with builtins errors (RuntimeError "Boolean value of Tensor
# with more than one value is ambiguous" on one rank, TypeError "unsupported operand type(s)
# for +=: 'Tensor' and 'list'" on the other).
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", MODES)
def test_accelerate_make_loader_through_prepare_never_double_shards(accelerate: dict, mode: str) -> None:
    assert_correct_or_refused(accelerate[f"{mode}:make:prepare"], fix="prepare")


# A DataLoader of your own over a contiguous/interleave shard, prepared, would be sharded again
# by BatchSamplerShard, silently: each rank would see about half of its shard. "epoch"
# (sampler=EpochShuffleSampler) is caught by the sampler's __iter__ under BatchSamplerShard;
# "plain" (torch's BatchSampler over a RandomSampler) by the dataset's set_epoch, which
# Accelerate's DataLoaderShard calls at the start of each pass when its sampler has none.
@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["contiguous:plain", "interleave:plain", "contiguous:epoch"])
def test_accelerate_own_loader_on_a_shard_through_prepare_never_double_shards(accelerate: dict,
                                                                              case: str) -> None:
    assert_correct_or_refused(accelerate[f"{case}:prepare"], fix="prepare")


@pytest.mark.timeout(240)
def test_accelerate_without_a_daemon_reads_the_same_rows_lazily(accelerate: dict) -> None:
    assert_every_row_once(accelerate["global:plain:prepare:lazy"], backend="lazy")  # its order: Accelerate's RNG
    for case in ("contiguous:make:own", "node:make:own"):
        lazy = accelerate[f"{case}:lazy"]
        assert_every_row_once(lazy, backend="lazy")
        assert [rank["epochs"] for rank in lazy] == [rank["epochs"] for rank in accelerate[case]]  # batch for batch
