"""Stream mode's blocks of fixed-size rows, gathered in one step per key whatever the window.

``DaemonBlocks`` maps each block's segment of every streamed key; here each key's blocks sit
side by side in one address range (segments/stitch.py), block ``b`` in slot ``slot_of[b]`` of
every key's range, so a batch's rows are one fancy index per key: ``view[slot_of[block],
row - block start]``. What a batch costs no longer grows with the blocks it spans (the window).

Only for fixed-size rows of page-aligned segments (every stream block segment: a header page,
then its rows: ``DaemonBlocks`` checks ``stitch.can_stitch``); variable-length keys keep
``gather_by_block``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from ...errors import SegmentError
from ...order.stream_order import BlockLayout
from ...segments import AttachedSegment
from ...segments.stitch import Stitch
from ...util.units import row_nbytes

__all__ = ["StitchedBlocks", "SLACK_SLOTS"]

SLACK_SLOTS = 4096  # slots past the window's capacity: one batch may span more blocks than the window holds


class StitchedBlocks:
    """The placed blocks of ``keys`` streamed keys (their segments' rows), at most ``slots`` at
    once; ``slot_of[b]`` is block ``b``'s slot, -1 when it is not placed."""

    def __init__(self, layout: BlockLayout, keys: int, capacity: int) -> None:
        self.layout = layout
        self.keys = keys
        self.slots = int(capacity) + SLACK_SLOTS
        self.slot_of = np.full(max(layout.n_blocks, 1), -1, dtype=np.int64)
        self._stitches: list[Stitch] = []
        self._views: list[np.ndarray] = []  # each key's slots: [slot, row, ...]
        self._flats: list[np.ndarray] = []  # the same rows as one axis: [slot * rows a slot + row, ...]
        self._free: list[int] = list(range(self.slots - 1, -1, -1))  # the lowest slot first
        self._pid = os.getpid()

    def _open(self, segments: list[AttachedSegment]) -> None:
        """One range per key, shaped by its first block's segment (rows, dtype)."""
        for segment in segments:
            m = segment.meta
            row = row_nbytes(m.row_shape, m.np_dtype)
            stitch = Stitch(self.slots, self.layout.block_rows * row, row)
            self._stitches.append(stitch)
            self._views.append(stitch.view(m.np_dtype, m.row_shape))
            self._flats.append(stitch.flat(m.np_dtype, m.row_shape))

    def place(self, block: int, segments: list[AttachedSegment]) -> None:
        """Map ``block``'s segments (one per key, in key order) into a free slot of every key's
        range; the segments' own mappings are dropped (their descriptors and leases stay).

        Raised when a segment does not match the key's first (dtype, row shape) or no slot is
        free: SegmentError."""
        if not self._stitches:
            self._open(segments)
        if not self._free:
            raise SegmentError(f"a batch spans more than the {self.slots} blocks a stream's window can place at once")
        slot = self._free.pop()
        done: list[Stitch] = []
        try:
            for stitch, view, segment in zip(self._stitches, self._views, segments):
                m = segment.meta
                if (m.np_dtype, m.row_shape) != (view.dtype, view.shape[2:]):
                    raise SegmentError(f"segment {segment.name} holds rows of {m.np_dtype} {m.row_shape}, not the "
                                       f"stream's {view.dtype} {view.shape[2:]}")
                stitch.place(segment.fileno(), m.header_size, m.nbytes, slot)
                done.append(stitch)
        except BaseException:
            for stitch in done:
                stitch.remove(slot)
            self._free.append(slot)
            raise
        for segment in segments:
            segment.unmap()
        self.slot_of[block] = slot

    def remove(self, block: int) -> None:
        """Let ``block``'s slot go (its mappings, and with them the files: the caller closes the
        segments' descriptors, which hold the leases)."""
        slot = int(self.slot_of[block])
        if slot < 0:
            return
        for stitch in self._stitches:
            stitch.remove(slot)
        self.slot_of[block] = -1
        self._free.append(slot)

    def missing(self, ids: np.ndarray) -> np.ndarray:
        """The blocks of ``ids`` not placed (each once, ascending)."""
        absent = self.slot_of[ids] < 0
        return np.unique(ids[absent]) if absent.any() else ids[:0]

    def gather(self, ids: np.ndarray, rows: np.ndarray) -> list[np.ndarray]:
        """Each key's rows ``rows`` (global) of the blocks ``ids`` (every one placed), in order:
        one ``take`` per key (global mode's gather), fresh arrays of the segments' dtype."""
        slots = self.slot_of[ids]
        if len(slots) and int(slots.min()) < 0:
            raise SegmentError("a stream block was gathered before it was placed")
        local = rows - self.layout.bounds[ids]
        return [flat.take(slots * view.shape[1] + local, axis=0) for flat, view in zip(self._flats, self._views)]

    def gather_each(self, ids: np.ndarray, rows: np.ndarray, place: Callable[[int], object]) -> list[np.ndarray]:
        """As ``gather``, a block at a time, each placed (``place(block)``) right before its rows
        are read: for a batch whose blocks cannot all be placed at once (the caller let placed
        blocks go while it waited for room)."""
        outs = [np.empty((len(rows), *view.shape[2:]), dtype=view.dtype) for view in self._views]
        order = np.argsort(ids, kind="stable")
        for group in np.split(order, np.flatnonzero(np.diff(ids[order])) + 1) if len(order) else []:
            block = int(ids[group[0]])
            if self.slot_of[block] < 0:
                place(block)
            slot = int(self.slot_of[block])
            if slot < 0:
                raise SegmentError(f"stream block {block} was not placed")
            local = rows[group] - self.layout.bounds[block]
            for out, view in zip(outs, self._views):
                out[group] = view[slot, local]
        return outs

    def close(self) -> None:
        """Unmap every key's range (in a forked child: its copies only)."""
        self._views, self._flats = [], []
        for stitch in self._stitches:
            stitch.close()
        self._stitches = []
        self.slot_of[:] = -1
        self._free = list(range(self.slots - 1, -1, -1))
