"""SharedH5Dataset: one rank's shard (or, in global mode, the whole file), served zero-copy
from the daemon or read lazily.

Both backends give the same ``indices`` and the same samples for the same local index, so a
run without a daemon is the same run, only slower; but for the order of ``mode="stream"`` with
``window=None`` (the window is sized by what holds it) and of global or node data a daemon has
no room for (it streams them): the fallback warning says which (``_fallback_order``).
"""

from __future__ import annotations

import dataclasses
import operator
import os
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import ConfigError, H5ServeError, falls_back
from ..hdf5.description import DatasetDescription
from ..hdf5.files import describe_files, expand_paths
from ..order.sharding import GLOBAL, NODE, Selection, node_selection, resolve_rank_world
from ..order.stream_order import STREAM, node_rows
from ..util.checks import is_int
from . import remote, ring
from .backends import progressive
from .backends.protocol import Backend
from .backends.sources import lazy_backend
from .fields import XY, Batch, DictBatch, FieldSet, SampleList, TupleBatch, collate, parse_fields
from .gather import as_positions, trusted_positions
from .options import DaemonOptions, StreamOptions, check_fallback, grouped
from .samplers.node import NodePlace
from .samplers.resharding import check_not_prepared, length_unless_resharded
from .spec import BackendSpec, describe_spec
from .streaming import automatic
from .streaming.backend import StreamBackend
from .streaming.batch import StreamBatch

if TYPE_CHECKING:
    from ..topology import NodeLayout
    from .ragged import RaggedColumn

__all__ = ["SharedH5Dataset", "Batch", "SampleList", "TupleBatch", "DictBatch", "collate"]


def _check_cache_bytes(value: Any) -> int | None:
    if value is None:
        return None
    if not is_int(value, numpy=True) or value < 0:
        raise ConfigError(f"cache_bytes must be a number of bytes >= 0 (0: no cache) or None (auto), got {value!r}")
    return int(value)


class SharedH5Dataset(Dataset):
    """This rank's shard of ``path[x_key]`` (and ``path[y_key]``), or of every key in ``keys``.

    ``keys=["image", "mask", "label"]``: samples and batches are tuples in that order;
    ``keys={"image": "data/img", "label": "meta/cls"}``: dicts with those names. ``dtypes``
    and ``transforms`` are dicts by field name (the key itself for a list). A key
    ``"events:energy"`` is field ``energy`` of the compound dataset ``events`` (a dataset
    literally named so wins; h5serve/hdf5/compound.py has the rule). Fixed-length byte strings
    come as lists of ``bytes``, or ``str`` decoded with ``encoding``. Every key must have
    the same number of rows.

    ``path``: one HDF5 file, a glob pattern (``"data/run_*.h5"``: expanded here and sorted)
    or a list of files: many files are one dataset, their rows concatenated in that order,
    in every mode and backend (they must agree on keys, row shape and dtype, or cast safely to
    ``dtype_x``/``dtype_y``; ``ds.files`` lists them). URLs (``s3://b/k.h5``): client/remote.py.

    Variable-length rows (``h5py.vlen_dtype(np.float32)``, variable-length strings): a
    sample is a 1-D tensor (strings: ``str``); a batch is, by ``ragged``, ``"list"`` a list
    of 1-D tensors, ``"pad"`` ``Padded(values, lengths)`` (a ``(batch, longest)`` tensor
    filled with ``pad_value``, default 0, past each row's end, and int64 lengths),
    ``"nested"`` a nested tensor (torch's jagged layout); strings are always a list of
    ``str`` (decoded with the encoding HDF5 records). h5serve/client/ragged.py.

    ``mode``: ``"contiguous"`` (balanced slices), ``"interleave"`` (rows ``r, r+W, ...``) or
    ``"global"``: every rank's dataset is the whole file (``len(ds)`` is every row,
    ``ds.indices`` is ``arange(total)``), one segment set per node shared by every rank and
    every job whatever its world size; use it with a distributed sampler
    (``make_loader`` picks ``DistributedShuffleSampler``; ``torch.utils.data.DistributedSampler``
    works too).

    ``mode="stream"``: data bigger than memory. Rows are addressed by their global number, as
    in global mode, and read in whole blocks (``block_rows``, a multiple of every key's chunk
    rows; default about 8 MiB) into a window of at most ``window`` bytes (``"2GiB"``: one order
    with or without a daemon; None: what the daemon's budget holds, or without one this rank's
    share of a quarter of the node's memory, shared again by make_loader's workers, the same on
    every rank of the node; the order then differs with and without a daemon when the file does
    not fit); ``make_loader`` picks a
    ``StreamSampler`` that draws each rank's rows across the blocks in the window
    (h5serve/order/stream_order.py). With a daemon, every block is a segment in the node's shared
    memory, one copy per node, prefetched in that order (client/streaming/daemon_blocks.py); without
    one, each process reads its blocks itself (client/streaming/backend.py). Every kind of data: many
    files (blocks laid out per file, never spanning two), variable-length rows (the window
    counts their values), strings, compressed chunks, several keys.

    ``auto_stream`` (default True): a global or node dataset the daemon refuses for room (its
    ``--max-memory`` budget, or /dev/shm) is served in stream mode instead of read lazily row
    by row, with one RuntimeWarning naming what the full mode needs, the budget and the window:
    then ``ds.mode == "stream"`` (``ds.requested_mode`` keeps what was asked, ``ds.auto_streamed``
    the plan) and make_loader's batches are block-shuffled (StreamSampler). Every rank decides
    alike (in a torch.distributed process group: one all-reduce, so build the dataset on every
    rank; client/streaming/automatic.py). No daemon: the lazy fallback as before.
    ``auto_stream=False``: the lazy fallback always.

    Rank and world size come from the arguments, else an initialized torch.distributed
    process group, else RANK / WORLD_SIZE, else 0 / 1. ``backend`` is ``"shm"`` when served
    by the daemon, ``"lazy"`` when read through h5py (``fallback="lazy"``, the default, when
    no daemon answers; ``fallback="error"`` raises DaemonUnavailable instead).

    Ready at once: when the daemon has not loaded the shard yet, the dataset does not wait for
    the load (``wait_ready=None``, the default, for shards of 64 MiB and more): it serves
    batches through h5py meanwhile (``backend == "lazy (loading)"``; same rows, order and bytes)
    and switches to shared memory between two batches once the daemon has them (each
    DataLoader worker on its own); a load that fails leaves h5py serving, with the fallback
    warning. ``wait_ready=True`` (and ``fallback="error"``) waits for the load in the
    constructor, as benchmarks want; ``wait_ready=False`` never waits, whatever the size;
    ``ds.wait_until_ready()`` waits later. h5serve/client/backends/progressive.py.

    The fast path: ``make_loader(ds, batch_size)``, or a DataLoader with
    ``collate_fn=h5serve.client.collate`` (one gather per batch, no per-sample tensors).
    ``cache_bytes``: the lazy backend keeps the chunks it has read in this process, up to
    the whole shard, when the shard fits in ``cache_bytes`` (default: half the node's
    available memory shared by the job's ranks on the node, ``LOCAL_WORLD_SIZE``; 0: never
    cache, read rows through HDF5 each time).

    The daemon is trusted only when its runtime dir, socket, pidfile and segments belong to
    this user, root, or ``daemon_user`` (a shared daemon's user name or uid; default
    ``$H5SERVE_DAEMON_USER``); any other is refused like a missing daemon (a warning naming
    the path and owner, then lazy reads).

    Grouped (client/options.py): ``stream=StreamOptions(...)``, ``place=NodePlace(...)`` and
    ``daemon=DaemonOptions(...)`` instead of their loose keywords (with one of them: ConfigError).

    Raised for bad arguments: ConfigError. Raised for a missing file or key, mismatched
    lengths or an unservable dtype: the DataError subclass that says which.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        x_key: str | None = None,
        y_key: str | None = None,
        *,
        keys: Sequence[str] | dict[str, str] | None = None,
        dtypes: dict[str, Any] | None = None,
        transforms: dict[str, Callable[[Any], Any]] | None = None,
        encoding: str | None = None,
        ragged: str = "list",
        pad_value: Any = None,
        mode: str = "contiguous",
        rank: int | None = None,
        world_size: int | None = None,
        dtype_x: Any = None,
        dtype_y: Any = None,
        transform: Callable[[torch.Tensor], Any] | None = None,
        target_transform: Callable[[torch.Tensor], Any] | None = None,
        fallback: str = "lazy",
        runtime_dir: str | os.PathLike[str] | None = None,
        timeout: float | None = None,
        cache_bytes: int | None = None,
        daemon_user: str | int | None = None,
        local_rank: int | None = None,
        local_world_size: int | None = None,
        node_rank: int | None = None,
        num_nodes: int | None = None,
        window: int | str | None = None,
        block_rows: int | None = None,
        auto_stream: bool = True,
        wait_ready: bool | None = None,
        stream: StreamOptions | None = None,
        place: NodePlace | None = None,
        daemon: DaemonOptions | None = None,
    ) -> None:
        window, block_rows, auto_stream = grouped("stream", stream, StreamOptions, window=window,
                                                  block_rows=block_rows, auto_stream=auto_stream)
        local_rank, local_world_size, node_rank, num_nodes = grouped(
            "place", place, NodePlace, local_rank=local_rank, local_world_size=local_world_size,
            node_rank=node_rank, num_nodes=num_nodes)
        runtime_dir, timeout, daemon_user, fallback, wait_ready = grouped(
            "daemon", daemon, DaemonOptions, runtime_dir=runtime_dir, timeout=timeout, daemon_user=daemon_user,
            fallback=fallback, wait_ready=wait_ready)
        check_fallback(fallback)
        self.fields: FieldSet = parse_fields(
            x_key, y_key, keys, dtype_x=dtype_x, dtype_y=dtype_y, transform=transform,
            target_transform=target_transform, dtypes=dtypes, transforms=transforms, encoding=encoding,
            ragged=ragged, pad_value=pad_value,
        )
        self.rank, self.world_size = resolve_rank_world(rank, world_size)
        self.layout: NodeLayout | None = None  # node mode: the layout this rank's node was resolved from
        layout_args = (local_rank, local_world_size, node_rank, num_nodes)
        if mode != STREAM and (window is not None or block_rows is not None):
            raise ConfigError(f"window and block_rows are for mode='stream' only (mode={mode!r}): drop them, or "
                              "use mode='stream'")
        if mode in (NODE, STREAM):
            selection = self._layout_selection(mode, rank, world_size, *layout_args)
        elif any(a is not None for a in layout_args):
            raise ConfigError("local_rank, local_world_size, node_rank and num_nodes (place=) describe the node for "
                              f"mode='node' only (and mode='stream'; mode={mode!r}): drop them, or use mode='node'")
        else:
            selection = Selection(mode, self.world_size, self.rank)
        sources = expand_paths(path)  # a pattern is expanded here, with this user's rights
        many = len(sources.paths) > 1
        self.spec = BackendSpec(
            path=sources.paths[0],
            keys=self.fields.keys,
            selection=selection,
            dtypes=self.fields.dtypes,
            runtime_dir=None if runtime_dir is None else os.fspath(runtime_dir),
            timeout=timeout, daemon_user=daemon_user,
            h5_options=self._h5_options(),
            cache_bytes=_check_cache_bytes(cache_bytes),
            files=sources.paths if many else (),
            pattern=sources.shown if many else "",
        )
        self.mode = self.requested_mode = mode
        self.fallback = fallback
        self.auto_stream = bool(auto_stream)
        self._wait_ready = None if wait_ready is None else bool(wait_ready)
        self.auto_streamed: automatic.StreamPlan | None = None  # set when global/node data is streamed instead
        self._described: DatasetDescription | None = None  # the files as h5py reads them: ``_description()``
        self._stream_args: tuple[object, object] = (window, block_rows)
        self._backend: Backend = self._open_backend()
        try:
            self.fields.check_encoding([d.kind for d in self._backend.out_dtypes])
            self.fields.check_ragged(self._backend.vlen_kinds, self._backend.out_dtypes)
        except ConfigError:
            self._backend.close()
            raise
        self.indices: np.ndarray = self.spec.selection.indices(self._backend.total_rows)

    def _layout_selection(self, mode: str, rank: int | None, world_size: int | None, *place: int | None) -> Selection:
        """Resolve which ranks share this node (h5serve.topology) and select their rows: node mode,
        its ranks' contiguous shards; stream mode, every row by its global number (blocks dealt to nodes).

        Raised when the layout is contradictory, the node's ranks are not consecutive (node mode)
        or the nodes run different numbers of ranks (stream mode): ConfigError."""
        from ..topology import resolve_layout

        local_rank, local_world_size, node_rank, num_nodes = place
        layout = resolve_layout(rank=rank, world_size=world_size, local_rank=local_rank,
                                local_world_size=local_world_size, node_rank=node_rank, num_nodes=num_nodes)
        if mode == STREAM and layout.world_size != layout.num_nodes * layout.local_world_size:
            raise ConfigError(f"mode='stream' needs the same number of ranks on every node: {layout.world_size} "
                              f"ranks on {layout.num_nodes} nodes, {layout.local_world_size} on this one")
        self.layout = layout
        self.rank, self.world_size = layout.rank, layout.world_size
        if mode == STREAM:
            return Selection(GLOBAL, self.world_size, self.rank)
        return node_selection(self.world_size, layout.ranks)

    # ----- backend choice --------------------------------------------------------------------
    def _h5_options(self) -> dict[str, Any]:
        return {}

    def _open_backend(self) -> Backend | StreamBackend | progressive.ProgressiveBackend:
        if remote.reads_here(self.spec, self._description, self.mode, self.fallback, self._shown_path()):
            return self._fallback_backend()  # a URL the daemon does not fetch (client/remote.py)
        if self.mode == STREAM:  # whole blocks: the daemon's segments, else read here (client/streaming/backend.py)
            return StreamBackend(self.spec, *self._stream_args,
                                 ranks=self.layout.local_world_size if self.layout else None,
                                 on_fallback=self._announce_fallback if self.fallback == "lazy" else None,
                                 description=self._description(),
                                 whole=self.auto_streamed.whole if self.auto_streamed else None)
        backend: Backend | progressive.ProgressiveBackend | None = None
        error = None
        try:  # ready at once: h5py serves while the daemon loads (client/backends/progressive.py)
            backend = progressive.connect(self.spec, self.rank, self._announce_fallback, self._description,
                                          True if self.fallback == "error" else self._wait_ready, self._settled)
        except H5ServeError as exc:
            error = exc
        if self.auto_stream and self.mode in (GLOBAL, NODE):  # a collective in a process group: every rank
            plan = automatic.decide(self.spec, error, self.world_size,
                                    self.layout.local_world_size if self.layout else None, self._description)
            if plan is not None:
                if backend is not None:
                    backend.close()
                return self._stream_instead(plan)
        if error is None:
            assert backend is not None
            return backend
        if self.fallback == "error" or not falls_back(error):  # errors.py: which ones lazy reads stand in for
            raise error
        self._announce_fallback(error)
        return self._fallback_backend()

    def _stream_instead(self, plan: automatic.StreamPlan) -> Backend | StreamBackend | progressive.ProgressiveBackend:
        """Serve a global/node dataset that does not fit shared memory in stream mode
        (client/streaming/automatic.py)."""
        warnings.warn(automatic.warning_text(plan, self.mode, self._shown_path()), RuntimeWarning, stacklevel=4)
        if self.layout is None:
            self._layout_selection(STREAM, self.rank, self.world_size, None, None, None, None)
        self.spec = dataclasses.replace(self.spec, selection=Selection(GLOBAL, self.world_size, self.rank))
        self.mode, self.auto_streamed, self._stream_args = STREAM, plan, (plan.window, plan.block_rows)
        return self._open_backend()

    def _settled(self, backend: Backend) -> None:
        """The daemon's load is over (client/backends/progressive.py): serve from ``backend`` directly."""
        self._backend = backend

    def _announce_fallback(self, exc: H5ServeError) -> None:
        warnings.warn(f"h5serve: {exc}. Reading {self._shown_path()} {self._fallback_order()}; pass fallback='error' "
                      "to fail instead.", RuntimeWarning, stacklevel=4)

    def _fallback_order(self) -> str:
        """How the rows read here without the daemon compare with the daemon's, for the fallback
        warning: the same rows, and the same order unless what the daemon would do differs."""
        if self.mode == STREAM and self._stream_args[0] is None:
            return ("through h5py instead (same rows, slower), in blocks and a window sized by this node's memory, "
                    "its ranks and each rank's DataLoader workers (window=None) where a daemon sizes them by its "
                    "budget: another order than a daemon's whenever that gives other blocks or another window. "
                    "Pass window= (bytes; block_rows= too, to pin the block) for one order with or without a daemon")
        if self.mode == STREAM:
            return "through h5py instead (same rows, same order: the window you passed, slower)"
        if self.mode in (GLOBAL, NODE) and self.auto_stream:
            return ("lazily through h5py instead (same rows, same order as a daemon that holds them whole; a daemon "
                    "without room for them streams them instead, block-shuffled: auto_stream=False keeps this "
                    "order there; slower)")
        return "lazily through h5py instead (same rows, same order, slower)"

    def _fallback_backend(self) -> Backend:
        return lazy_backend(self.spec, self._description())

    def _description(self) -> DatasetDescription:
        """The files and keys as h5py reads them (hdf5/description.py), described once, when a
        backend that reads them here needs it (the shm backend does not: the daemon reads them).

        Raised as hdf5.description.describe is: the DataError that says which file or key."""
        if self._described is None:
            self._described = describe_spec(self.spec)
        return self._described

    def _shown_path(self) -> str:
        """The path, or for many files the pattern (or list) and what it expanded to."""
        if not self.spec.files:
            return self.spec.path
        return describe_files(self.spec.files, self.spec.pattern)

    @property
    def backend(self) -> str:
        """``"shm"`` (daemon), ``"lazy"`` (h5py), ``"lazy (loading)"`` (h5py while the daemon
        loads the shard; asking checks, without waiting, whether it is done) or ``"memory"``
        (compat preload)."""
        self._backend.check()
        return self._backend.name

    def wait_until_ready(self, timeout: float | None = None) -> str:
        """Wait until the daemon has loaded the shard and this process serves it from shared
        memory (or the load failed and h5py serves on), at most ``timeout`` seconds; the
        backend then. Returns at once when nothing is loading."""
        return self._backend.wait(timeout)

    @property
    def files(self) -> tuple[str, ...]:
        """The files whose rows this dataset concatenates, in order (one file: that file)."""
        return self.spec.files or (self.spec.path,)

    @property
    def total_rows(self) -> int:
        """Rows in the whole dataset, across all ranks."""
        return self._backend.total_rows

    def shard_sizes(self) -> list[int]:
        """Rows in every rank's shard, rank 0 first: what make_loader gives every rank the
        same number of batches from (global mode: every rank has all rows; stream mode: every
        rank's share of its node's blocks, before equalising)."""
        stream = self.stream
        if stream is not None and self.layout is not None:
            local = self.layout.local_world_size
            return [len(range(r, n, local)) for n in node_rows(stream.config.layout, self.layout.num_nodes)
                    for r in range(local)]
        return self.spec.selection.sizes(self.total_rows)

    @property
    def stream(self) -> StreamBackend | None:
        """Stream mode: the backend that holds the blocks (``.config``: block layout and window
        capacity; ``.cache``: the blocks held); None in other modes."""
        return self._backend if isinstance(self._backend, StreamBackend) else None

    def _unwrap(self, indices: Any) -> Any:
        """A stream sampler's batch as its rows, after freeing the blocks its window no longer
        holds (and, from a daemon, asking for the blocks it takes next)."""
        if isinstance(indices, StreamBatch):
            self._backend.retain(indices)
            return indices.rows
        return indices

    # ----- x/y transforms, settable as before ---------------------------------------------------
    @property
    def transform(self) -> Callable[[Any], Any] | None:
        """x's per-sample transform (x_key/y_key datasets; ``keys=`` datasets: ``transforms=``)."""
        return self.fields.transform_of("x")

    @transform.setter
    def transform(self, fn: Callable[[Any], Any] | None) -> None:
        self.fields = self.fields.with_transform("x", fn)

    @property
    def target_transform(self) -> Callable[[Any], Any] | None:
        """y's per-sample transform."""
        return self.fields.transform_of("y")

    @target_transform.setter
    def target_transform(self, fn: Callable[[Any], Any] | None) -> None:
        self.fields = self.fields.with_transform("y", fn)

    # ----- access ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.indices) if self.world_size == 1 else length_unless_resharded(self)

    def set_epoch(self, epoch: int) -> None:
        """Nothing to set (the order is the sampler's): Accelerate calls it when its sampler has none.
        Raised for a rank-sharded dataset of 2+ ranks: ConfigError (samplers/resharding.py)."""
        check_not_prepared(self)

    def _gather(self, local: Sequence[int] | np.ndarray | torch.Tensor,
                ) -> Sequence[torch.Tensor | np.ndarray | RaggedColumn]:
        return self._backend.gather(as_positions(self._unwrap(local), len(self.indices)))

    def __getitem__(self, index: int) -> Any:
        return self.fields.sample(self._gather([operator.index(index)]))

    def __getitems__(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> Sequence[Any] | ring.RingBatch:
        """A whole batch with one vectorised gather per key (DataLoader calls this): a Batch,
        SampleList, TupleBatch or DictBatch for ``collate``, or per-sample results when there
        are transforms (h5serve/client/fields.py). In a make_loader worker, a plain x or (x, y)
        batch is gathered straight into the worker's ring (h5serve/client/ring.py)."""
        batch = indices
        indices = self._unwrap(indices)
        if ring.active() and self._ring_ready():
            columns = ring.gather(self._backend, as_positions(indices, len(self.indices)))
            self._finish(batch)
            if isinstance(columns, ring.RingBatch):
                return columns
            return self.fields.batch(columns)
        gathered = self._gather(indices)
        self._finish(batch)
        return self.fields.batch(gathered)

    def _finish(self, batch: Any) -> None:
        """After a stream batch is gathered (copied out): close the blocks this rank has used for
        the last time (``StreamBatch.done``), so their room is free now, not a batch later."""
        if isinstance(batch, StreamBatch):
            self._backend.finish(batch)

    def collated_batch(self, positions: np.ndarray) -> Any:
        """``collate(self.__getitems__(positions))`` for int64 ``positions`` already known to lie in
        ``[0, len(self))``, with no check per batch: what ShmDataLoader's own iterator calls with
        views of its batch sampler's order, checked once a pass (``IndexBatches.within``). Only for
        a dataset whose batches are SharedH5Dataset's own (``plain_batches``)."""
        columns = self._backend.gather(trusted_positions(positions))
        fields = self.fields
        if fields.layout == XY and not fields.transformed:  # what collate returns, without the Batch between
            x = columns[0]
            if len(columns) == 1:
                if isinstance(x, torch.Tensor):
                    return x
            elif isinstance(x, torch.Tensor) and isinstance(columns[1], torch.Tensor):
                return x, columns[1]
        return collate(fields.batch(columns))

    def _ring_ready(self) -> bool:
        """Whether batches are plain numeric tensors of x (and y), which a ring slot holds
        (not variable-length rows: their columns are ragged)."""
        return (self.fields.layout == XY and not self.fields.transformed and not any(self._backend.vlen_kinds)
                and all(np.dtype(d).kind in "biufc" for d in self._backend.out_dtypes))

    def plain_batches(self) -> bool:
        """Whether ``collated_batch`` gives what DataLoader would (``collate`` of ``__getitems__``):
        batches gathered as SharedH5Dataset gathers them (neither method overridden by a
        subclass), outside a make_loader worker's ring."""
        cls = type(self)
        return (cls.__getitems__ is SharedH5Dataset.__getitems__ and cls._gather is SharedH5Dataset._gather
                and not ring.active())

    def close(self) -> None:
        """Release the mapping and lease (or the h5py handle) held by this process."""
        self._backend.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self._shown_path() if self.spec.files else repr(self.spec.path)}, "
            f"{self._keys_repr()}, "
            f"mode={self.mode!r}, rank={self.rank}, world_size={self.world_size}, backend={self.backend!r}, "
            f"rows={len(self)})"
        )

    def _keys_repr(self) -> str:
        f = self.fields
        if f.layout == "xy":
            return f"x_key={f.keys[0]!r}, y_key={f.keys[1] if len(f.keys) > 1 else None!r}"
        if f.layout == "dict":
            return f"keys={ {x.name: x.key for x in f.fields}!r}"
        return f"keys={list(f.keys)!r}"
