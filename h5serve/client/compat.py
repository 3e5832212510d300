"""The predecessor's API, in one place: its rank-cached dataset (RankMemCachedH5Dataset, with
its signature, here), its lazy reader and worker hook (H5LazyDataset, h5_worker_init_fn:
client/lazy.py) and its sharding helpers (balanced_contiguous_shard, interleaved_indices,
shard_indices: h5serve/order/sharding.py, torch-free). ``h5serve.client`` gives the same names
by attribute, as it always did.

RankMemCachedH5Dataset: the predecessor's rank-cached dataset.

Served from the daemon when one runs (the shard is shared by every job on the node and the
float32 cast happens per batch, so a uint8 dataset costs uint8 memory). With no daemon it
behaves like the predecessor: the rank's shard is read once into this process's memory.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import H5ServeError
from ..order.sharding import balanced_contiguous_shard, interleaved_indices, shard_indices
from .backends.protocol import Backend
from .backends.sources import MemoryBackend
from .dataset import SharedH5Dataset
from .lazy import H5LazyDataset, h5_worker_init_fn

__all__ = ["RankMemCachedH5Dataset", "H5LazyDataset", "h5_worker_init_fn", "balanced_contiguous_shard",
           "interleaved_indices", "shard_indices"]


class RankMemCachedH5Dataset(SharedH5Dataset):
    """This rank's shard, cached once: in the daemon's shared memory, else in this process.

    ``pin_host_memory`` pins the private cache when CUDA is available (ignored on CPU-only
    machines and for daemon-served shards, whose batches are fresh tensors you can pin with
    ``DataLoader(pin_memory=True)``). ``share_memory`` moves the private cache into torch
    shared memory. ``log_fn`` receives the one-line notes the predecessor printed.
    """

    def __init__(
        self,
        path: str,
        x_key: str,
        y_key: str | None = None,
        *,
        mode: str = "contiguous",
        dtype_x: Any = np.float32,
        dtype_y: Any = None,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        pin_host_memory: bool = True,
        share_memory: bool = False,
        rdcc_nbytes: int = 256 * 1024**2,
        rdcc_nslots: int = 1_000_003,
        rdcc_w0: float = 0.75,
        swmr: bool = True,
        log_fn: Callable[[str], None] = print,
    ) -> None:
        self._rdcc = {"rdcc_nbytes": rdcc_nbytes, "rdcc_nslots": rdcc_nslots, "rdcc_w0": rdcc_w0, "swmr": swmr}
        self.pin_host_memory = pin_host_memory
        self.share_memory = share_memory
        self.log_fn = log_fn
        super().__init__(
            path, x_key, y_key, mode=mode, dtype_x=dtype_x, dtype_y=dtype_y,
            transform=transform, target_transform=target_transform, fallback="lazy", wait_ready=True,
        )
        self.log_fn(
            f"[rank {self.rank}/{self.world_size}] cached {len(self)} of {self.total_rows} rows of "
            f"{os.path.basename(self.spec.path)} ({mode}) in "
            f"{'shared memory (h5serve daemon)' if self.backend == 'shm' else 'process memory'}"
        )

    def _h5_options(self) -> dict[str, Any]:
        return self._rdcc

    def _announce_fallback(self, exc: H5ServeError) -> None:
        self.log_fn(f"[rank {self.rank}] h5serve daemon not used ({exc}); preloading the shard into process memory")

    def _fallback_backend(self) -> Backend:
        backend = MemoryBackend.load(self.spec, self._description())
        if self.share_memory:
            backend.arrays = [torch.from_numpy(a).share_memory_().numpy() for a in backend.arrays]
        if self.pin_host_memory and torch.cuda.is_available():
            backend.arrays = [torch.from_numpy(a).pin_memory().numpy() for a in backend.arrays]
        return backend
