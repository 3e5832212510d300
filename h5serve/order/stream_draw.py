"""How a node's rows are drawn across its window of blocks (stream_order, step 2): given each
block's key range ``[lo_k, hi_k)``, the order in which its rows come. Pure numpy, O(rows).

*Stratified runs* (the draw): block ``k``'s rows, permuted, are cut into groups of ``run``
consecutive rows (``run`` = the node's local ranks; the last group may be shorter), and its
``G_k`` groups are spread evenly over its key range: group ``g`` gets a key in the middle
half of the ``g``-th of ``G_k`` equal strata of ``[lo_k, hi_k)``, uniform there. The node's
sequence is the groups sorted by key, each group's rows together. So

- a group's ``run`` rows sit at consecutive positions of the node's sequence, and position
  ``p`` goes to local rank ``p % run``: every rank gets one row of every group, so every rank
  draws from every block of the window in proportion, not only the node as a whole
  (stratifying single rows instead put a block's rows on the same ranks whenever its spacing
  was a multiple of ``run``: with 3 ranks and 6 blocks, a rank's batches held half of them);
- a block's groups keep half a stratum apart, so a rank seldom reads two rows of one block
  in a row (about once in ``W ** 2`` pairs, against once in ``W`` with uniform keys), and each
  of its batches holds the window's blocks in their shares (uniform keys scatter them
  multinomially);
- every key stays in its block's range, so the window's bound (at most ``W`` blocks with
  unread rows at any position) holds exactly as it does for any keys in those ranges.

Measured with Streaming's neighbour-difference entropy of rank 0's epoch (2 ranks, the bench's
87,381 rows, the windows its 5 / 10 / 25% budgets give): 14.06 / 14.35 / 14.49 bits with uniform
keys, 14.75 / 14.80 / 14.80 in stratified runs (a full permutation: 14.84); tests/unit/
test_stream_draw.py counts the per-rank shares.

*Uniform keys* (``run=0``): every row's key uniform over its block's range, the draw before
stratified runs, kept so that a checkpoint saved with it resumes its epoch exactly.
"""

from __future__ import annotations

import numpy as np

__all__ = ["GROUP_JITTER", "block_rows", "draw_sequence", "shuffled_rows"]

GROUP_JITTER = 0.5  # a group's key is uniform over this middle share of its stratum


def block_rows(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The rows ``[starts[k], starts[k] + sizes[k])`` of every block ``k`` in file order, blocks one
    after another (int64)."""
    return np.arange(int(sizes.sum()), dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes) + \
        np.repeat(starts, sizes)


def shuffled_rows(starts: np.ndarray, sizes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The rows ``[starts[k], starts[k] + sizes[k])`` of every block ``k``, each block's rows
    permuted among themselves, blocks one after another (O(rows): one pass per block size; many
    files leave short blocks of many sizes, grouped by one sort of the block sizes)."""
    offsets = np.cumsum(sizes) - sizes
    out = np.empty(int(sizes.sum()), dtype=np.int64)
    by_size = np.argsort(sizes, kind="stable")
    values, counts = np.unique(sizes[by_size], return_counts=True)
    for size, which in zip(values.tolist(), np.split(by_size, np.cumsum(counts)[:-1])):
        rows = rng.permuted(np.broadcast_to(np.arange(size, dtype=np.int64), (len(which), size)), axis=1)
        rows += starts[which][:, None]
        if len(which) == len(sizes):
            return rows.ravel()
        out[(offsets[which][:, None] + np.arange(size)).ravel()] = rows.ravel()
    return out


def draw_sequence(starts: np.ndarray, sizes: np.ndarray, lo: np.ndarray, hi: np.ndarray, run: int,
                  rng: np.random.Generator) -> np.ndarray:
    """The global rows of blocks ``k`` (rows ``[starts[k], starts[k] + sizes[k])``, keys in
    ``[lo[k], hi[k])``) in the node's order: stratified runs of ``run`` rows, or uniform keys
    for ``run=0`` (module docstring). int64, every row once."""
    starts, sizes = np.asarray(starts, dtype=np.int64), np.asarray(sizes, dtype=np.int64)
    if run == 0:
        owner = np.repeat(np.arange(len(sizes)), sizes)
        rows = block_rows(starts, sizes)
        keys = lo[owner] + rng.random(len(rows)) * (hi - lo)[owner]
        return rows[np.argsort(keys)]  # as drawn before: introsort, deterministic
    groups = -(-sizes // run)
    total = int(groups.sum())
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(groups) - groups, groups)
    jitter = (0.5 - GROUP_JITTER / 2) + GROUP_JITTER * rng.random(total, dtype=np.float32)
    keys = np.repeat(lo, groups) + (within + jitter) * np.repeat((hi - lo) / groups, groups)
    order = np.argsort(keys, kind="stable")  # each block's keys ascend: a merge of runs, and ties keep block order
    rows = shuffled_rows(starts, sizes, rng)
    if run == 1:
        return rows[order]
    first = (np.repeat(np.cumsum(sizes) - sizes, groups) + within * run)[order]  # each group's first place in rows
    end = np.repeat(np.cumsum(sizes), groups)[order]
    places = first[:, None] + np.arange(run, dtype=np.int64)
    inside = places < end[:, None]
    return rows[places.ravel()] if inside.all() else rows[places[inside]]
