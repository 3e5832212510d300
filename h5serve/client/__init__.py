"""The training side of h5serve: datasets and samplers for each DDP rank.

Light, fork- and spawn-safe; never imports ``h5serve.daemon``.

``__all__`` is the core API: the dataset and its option groups (``StreamOptions``, ``NodePlace``,
``DaemonOptions``), ``make_loader`` and its loader, the samplers, ``collate`` and the batch types a
loop receives, the loader's statistics, and the base error (every error class is in ``h5serve``).
The predecessor's names (``RankMemCachedH5Dataset``, ``H5LazyDataset``, ``h5_worker_init_fn`` and
its sharding helpers) are in ``h5serve.client.compat`` and, as before, importable from here by name.

May import: h5serve.hdf5, h5serve.segments, h5serve.topology, h5serve.wire, h5serve.order, h5serve.util,
h5serve.errors
"""

from typing import Any

from ..errors import H5ServeError
from .dataloader import ShmDataLoader, make_loader, seed_worker
from .dataset import Batch, DictBatch, SampleList, SharedH5Dataset, TupleBatch, collate
from .options import DaemonOptions, StreamOptions
from .ragged import Padded, RaggedList
from .samplers.node import NodePlace, NodeShuffleSampler
from .samplers.shuffle import DistributedShuffleSampler, EpochBatchSampler, EpochShuffleSampler
from .stats import LoaderSnapshot, LoaderStats
from .streaming.batch import StreamBatch
from .streaming.sampler import StreamSampler

__all__ = [
    "SharedH5Dataset",
    "StreamOptions",
    "DaemonOptions",
    "make_loader",
    "ShmDataLoader",
    "seed_worker",
    "EpochShuffleSampler",
    "EpochBatchSampler",
    "DistributedShuffleSampler",
    "NodePlace",
    "NodeShuffleSampler",
    "StreamSampler",
    "collate",
    "Batch",
    "SampleList",
    "TupleBatch",
    "DictBatch",
    "StreamBatch",
    "Padded",
    "RaggedList",
    "LoaderStats",
    "LoaderSnapshot",
    "H5ServeError",
]

_COMPAT = frozenset({"RankMemCachedH5Dataset", "H5LazyDataset", "h5_worker_init_fn", "balanced_contiguous_shard",
                     "interleaved_indices", "shard_indices"})


def __getattr__(name: str) -> Any:
    """The predecessor's names, from h5serve.client.compat: ``from h5serve.client import H5LazyDataset``;
    DaemonClient, no longer part of the training API, for one release with a DeprecationWarning."""
    if name in _COMPAT:
        from . import compat

        return getattr(compat, name)
    if name == "DaemonClient":
        import warnings

        from ..wire.connection import DaemonClient

        warnings.warn("h5serve.client.DaemonClient is not part of the training API: import it from "
                      "h5serve.wire.connection (this name goes in the next release)", DeprecationWarning, stacklevel=2)
        return DaemonClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
