"""Shuffle quality per mode: which rows and classes rank 0 of a job sees, epoch after epoch.

The data is class-sorted (labels in contiguous blocks, as files written class by class are),
the worst case for a fixed per-rank shard. Every rank's dataset is a real ``SharedH5Dataset``
served by a real daemon, iterated through ``make_loader(ds, batch_size, seed=...)`` with
``set_epoch`` per epoch: the rows are those a job sees. The file's x is each row's own number
and y its label, so a batch says exactly which rows and classes it holds. torch's
``DistributedSampler`` over the same rows is the reference. Deterministic (no timing).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import h5py
import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from h5serve.client import SharedH5Dataset, make_loader

from .common import BenchDaemon, log

ROWS, CLASSES, EPOCHS, BATCH, SEED = 20_000, 10, 4, 256, 42

# (label, mode, ranks, ranks per node): the job layouts measured; rank 0 is reported
LAYOUTS: tuple[tuple[str, str, int, int], ...] = (
    ("contiguous", "contiguous", 2, 2),
    ("interleave", "interleave", 2, 2),
    ("node", "node", 2, 2),
    ("global", "global", 2, 2),
    ("DistributedSampler (reference)", "torch", 2, 2),
    ("node, 2 nodes x 2 ranks", "node", 4, 2),
)

Batches = list[tuple[np.ndarray, np.ndarray]]  # (rows, labels) per batch


@dataclass
class Quality:
    """What rank 0 saw over the epochs; ``coverage``: the share of the rows all ranks
    together saw in an epoch (mean over epochs); ``as_reference``: whether rank 0's batches
    were DistributedSampler's (same world size, seed and batch size), row for row."""

    layout: str
    share_seen: float
    overlap: float
    classes_per_batch: float
    classes_seen: int
    coverage: float
    as_reference: bool


def class_sorted_file(directory: Path, rows: int = ROWS, classes: int = CLASSES) -> Path:
    """``row`` (int64 row numbers) and ``label`` (int64, ``classes`` blocks of equal size, in order)."""
    path = directory / f"class-sorted-{rows}-{classes}.h5"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with h5py.File(tmp, "w") as f:
            f.create_dataset("row", data=np.arange(rows, dtype=np.int64), chunks=(min(rows, 4096),))
            f.create_dataset("label", data=np.arange(rows, dtype=np.int64) * classes // rows,
                             chunks=(min(rows, 4096),))
        os.replace(tmp, path)
    return path


def _h5serve_epochs(path: Path, mode: str, ranks: int, per_node: int, runtime_dir: Path, epochs: int,
                    batch: int, seed: int) -> list[list[Batches]]:
    """Every rank's batches (``[rank][epoch]``) from SharedH5Dataset + make_loader."""
    out = []
    for rank in range(ranks):
        layout = {}
        if mode == "node":
            layout = {"local_rank": rank % per_node, "local_world_size": per_node, "node_rank": rank // per_node,
                      "num_nodes": ranks // per_node}
        ds = SharedH5Dataset(path, "row", "label", mode=mode, rank=rank, world_size=ranks, runtime_dir=runtime_dir,
                             fallback="error", **layout)
        loader = make_loader(ds, batch, seed=seed)
        per_epoch = []
        for epoch in range(epochs):
            loader.batch_sampler.set_epoch(epoch)
            per_epoch.append([(x.numpy().copy(), y.numpy().copy()) for x, y in loader])
        out.append(per_epoch)
        ds.close()
    return out


def _torch_epochs(path: Path, ranks: int, epochs: int, batch: int, seed: int) -> list[list[Batches]]:
    """The reference: DataLoader over DistributedSampler(shuffle=True, seed=seed), per rank."""
    with h5py.File(path, "r") as f:
        data = TensorDataset(torch.from_numpy(f["row"][...]), torch.from_numpy(f["label"][...]))
    out = []
    for rank in range(ranks):
        sampler = DistributedSampler(data, num_replicas=ranks, rank=rank, shuffle=True, seed=seed)
        loader = DataLoader(data, batch_size=batch, sampler=sampler)
        per_epoch = []
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            per_epoch.append([(x.numpy(), y.numpy()) for x, y in loader])
        out.append(per_epoch)
    return out


def _rows(batches: Batches) -> np.ndarray:
    return np.unique(np.concatenate([rows for rows, _ in batches]))


def _same(a: list[Batches], b: list[Batches]) -> bool:
    return [len(e) for e in a] == [len(e) for e in b] and all(
        np.array_equal(x[0], y[0]) for ea, eb in zip(a, b) for x, y in zip(ea, eb))


def quality(layout: str, seen: list[list[Batches]], total: int, reference: list[list[Batches]]) -> Quality:
    """The figures of rank 0 (``seen[0]``) over its epochs, ``reference``: DistributedSampler's."""
    epochs = [_rows(b) for b in seen[0]]
    jaccard = [len(np.intersect1d(a, b)) / len(np.union1d(a, b)) for a, b in zip(epochs, epochs[1:])]
    batches = [labels for epoch in seen[0] for _, labels in epoch]
    covered = [len(np.unique(np.concatenate([_rows(rank[e]) for rank in seen]))) / total
               for e in range(len(seen[0]))]
    return Quality(layout=layout, share_seen=len(np.unique(np.concatenate(epochs))) / total,
                   overlap=float(np.mean(jaccard)) if jaccard else 1.0,
                   classes_per_batch=float(np.mean([len(np.unique(b)) for b in batches])),
                   classes_seen=len(np.unique(np.concatenate(batches))), coverage=float(np.mean(covered)),
                   as_reference=_same(seen[0], reference[0]))


def shuffle_quality(path: Path, runtime_dir: Path, epochs: int = EPOCHS, batch: int = BATCH,
                    seed: int = SEED) -> list[Quality]:
    """Every layout of LAYOUTS on ``path`` (a class_sorted_file), served by the daemon at ``runtime_dir``."""
    with h5py.File(path, "r") as f:
        total = int(f["row"].shape[0])
    references: dict[int, list[list[Batches]]] = {}
    out = []
    for label, mode, ranks, per_node in LAYOUTS:
        if ranks not in references:
            references[ranks] = _torch_epochs(path, ranks, epochs, batch, seed)
        if mode == "torch":
            seen = references[ranks]
        else:
            seen = _h5serve_epochs(path, mode, ranks, per_node, runtime_dir, epochs, batch, seed)
        out.append(quality(label, seen, total, references[ranks]))
    return out


def run_shuffle(data_dir: Path) -> list[Quality]:
    """The ``shuffle`` group: the default file and layouts, on a fresh daemon."""
    log(f"shuffle quality ({ROWS} class-sorted rows, {CLASSES} classes, {EPOCHS} epochs)")
    path = class_sorted_file(data_dir)
    with BenchDaemon() as daemon:
        return shuffle_quality(path, daemon.runtime_dir)


def shuffle_table(qualities: list[Quality]) -> str:
    lines = [f"| mode (rank 0) | share of the rows seen in {EPOCHS} epochs | overlap of consecutive epochs "
             "(Jaccard) | distinct classes per batch | classes ever seen | rows per epoch, all ranks "
             "| DistributedSampler's batches |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for q in qualities:
        lines.append(f"| {q.layout} | {q.share_seen:.3f} | {q.overlap:.3f} | {q.classes_per_batch:.2f} | "
                     f"{q.classes_seen} of {CLASSES} | {q.coverage:.3f} | {'yes' if q.as_reference else 'no'} |")
    return "\n".join(lines)


def shuffle_chart(qualities: list[Quality], out: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed (pip install -e '.[bench]'): no shuffle chart")
        return False
    labels = [q.layout.replace(" (reference)", "\n(reference)").replace(", ", ",\n") for q in qualities]
    panels = ((f"share of the rows seen in {EPOCHS} epochs", [q.share_seen for q in qualities], 1.0),
              ("overlap of consecutive epochs (Jaccard)", [q.overlap for q in qualities], 1.0),
              ("distinct classes per batch", [q.classes_per_batch for q in qualities], CLASSES))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), sharey=True)
    y = np.arange(len(qualities))
    colors = ["#8c8c8c" if "reference" in q.layout else "#3b7dd8" for q in qualities]
    for ax, (title, values, top) in zip(axes, panels):
        ax.barh(y, values, color=colors)
        ax.set_xlim(0, top * 1.05)
        ax.set_title(title, fontsize=10)
        for yi, v in zip(y, values):
            ax.text(v, yi, f" {v:.2f}", va="center", fontsize=8)
    axes[0].set_yticks(y, labels, fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(f"rank 0 of a job, class-sorted file ({ROWS:,} rows, {CLASSES} classes), batch {BATCH}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def shuffle_section(qualities: list[Quality], png: bool) -> str:
    if not qualities:
        return "(the shuffle group was not run)"
    return f"""Which rows and classes rank 0 of a 2-rank job on one node sees over {EPOCHS} epochs, on a
class-sorted file ({ROWS:,} rows, {CLASSES} classes in blocks of {ROWS // CLASSES:,}, as a file written class by
class is), batch {BATCH}. Each rank's `SharedH5Dataset` is served by a daemon and iterated with
`make_loader(ds, batch_size={BATCH}, seed={SEED})` and `set_epoch` per epoch: the rows a job sees
(x is each row's number, y its label). Deterministic: no timing, the same on every machine.

{shuffle_table(qualities)}

{"![shuffle quality](shuffle.png)" if png else "(no chart: matplotlib was not installed)"}

- *share seen*: distinct rows rank 0 saw over the {EPOCHS} epochs, of all rows; *overlap*: Jaccard
  index of rank 0's rows in consecutive epochs (mean of the {EPOCHS - 1} pairs; 1.0: the same rows every
  epoch); *classes per batch*: mean distinct labels in rank 0's batches; *rows per epoch, all
  ranks*: share of the rows the job's ranks saw together in an epoch (mean); *DistributedSampler's
  batches*: rank 0's batches are, row for row, those of `DataLoader(batch_size={BATCH},
  sampler=DistributedSampler(shuffle=True, seed={SEED}))` with the same world size.
- `global` is DistributedSampler's order exactly; `node` on one node permutes the same rows
  from its own generator, so the same figures, not the same batches. Two random halves of the
  data in consecutive epochs overlap by 1/3 (Jaccard), and 1 - 0.5^{EPOCHS} = {1 - 0.5**EPOCHS:.2f} of the rows
  are seen in {EPOCHS} epochs.
- `contiguous` holds rank 0 to half the file, and on class-sorted data to half the classes,
  forever: `make_loader` shuffles within the shard, so batches mix the {CLASSES // 2} classes the shard has
  (never {CLASSES}). `interleave` gives every class to every rank but the same rows every epoch.
  Under DDP the gradient of a step averages both ranks (all {CLASSES} classes); what stays per rank is
  BatchNorm's batch statistics and anything else computed from one rank's batch.
- `node, 2 nodes x 2 ranks` (explicit layout, rank 0 on node 0): each node shuffles its own
  half of the file, so rank 0 never sees the other node's rows or classes: node mode across
  nodes is a node-level shard, reshuffled every epoch.
"""


def as_dicts(qualities: list[Quality]) -> list[dict]:
    return [asdict(q) for q in qualities]
