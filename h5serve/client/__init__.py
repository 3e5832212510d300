"""The training side of h5serve: datasets and samplers for each DDP rank.

Light, fork- and spawn-safe; never imports ``h5serve.daemon``.

May import: h5serve.hdf5, h5serve.segments, h5serve.topology, h5serve.wire, h5serve.order, h5serve.util,
h5serve.errors
"""

from ..order.sharding import balanced_contiguous_shard, interleaved_indices, shard_indices
from .compat import RankMemCachedH5Dataset
from .connection import DaemonClient
from .dataset import Batch, SampleList, SharedH5Dataset, collate
from .lazy import H5LazyDataset, h5_worker_init_fn
from .loader import ShmDataLoader, make_loader, seed_worker
from .node_sampler import NodePlace, NodeShuffleSampler
from .ragged import Padded, RaggedList
from .sampler import DistributedShuffleSampler, EpochBatchSampler, EpochShuffleSampler
from .stats import LoaderSnapshot, LoaderStats
from .stream_sampler import StreamSampler

__all__ = [
    "NodePlace",
    "NodeShuffleSampler",
    "StreamSampler",
    "SharedH5Dataset",
    "make_loader",
    "ShmDataLoader",
    "EpochShuffleSampler",
    "EpochBatchSampler",
    "DistributedShuffleSampler",
    "LoaderStats",
    "LoaderSnapshot",
    "seed_worker",
    "H5LazyDataset",
    "RankMemCachedH5Dataset",
    "h5_worker_init_fn",
    "balanced_contiguous_shard",
    "interleaved_indices",
    "shard_indices",
    "Batch",
    "SampleList",
    "Padded",
    "RaggedList",
    "collate",
    "DaemonClient",
]
