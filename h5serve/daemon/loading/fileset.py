"""Many files as one dataset, on the daemon's side: the segment metadata that names them all,
and a loader part's reads, file by file.

Every file of an acquire's ``files`` list is resolved as one file is (resolve.py's
``resolve_files``: opened once, real path under ``--allow-root``, readable by the requesting
user, metadata from the very file opened), and so does every file its rows come from (an
external link's target, a virtual dataset's sources). Every identity is part of the segment
name (``SegmentMeta.files`` / ``depends``): any file changed, replaced or removed maps to a new
segment, and the stale sweep evicts the old one once unheld, as for one file.
"""

from __future__ import annotations

from collections.abc import Callable

import h5py

from ...errors import SourceChanged
from ...hdf5.compound import FieldRows
from ...hdf5.files import check_agreement, pieces
from ...hdf5.identity import open_h5_verified, pinned_rows
from ...hdf5.rawcopy import Hasher, data_extents, drop_cached
from ...hdf5.reads import ShardWrite, read_shard_into
from ...hdf5.source import DatasetInfo, inspect_dataset, resolve_dtype, storage_dtype
from ...order.sharding import RowRange, Selection
from ...segments import SegmentMeta, SegmentWriter
from ...util.units import row_nbytes
from ...wire.protocol import Acquire
from ..access.resolved import ResolvedFiles

__all__ = ["files_meta", "read_files_part"]


def _depends(resolved: ResolvedFiles) -> tuple[tuple, ...]:
    """The other files the rows come from (linked targets, virtual sources), each once."""
    seen: dict[tuple, None] = {}
    for member in resolved.members:
        for ident in ((member.linked,) if member.linked else ()) + member.sources:
            seen[ident.as_tuple()] = None
    return tuple(seen)


def files_meta(req: Acquire, resolved: ResolvedFiles) -> SegmentMeta:
    """The segment metadata for ``req``'s rows of the concatenated files.

    Raised when the files disagree on the kind of rows, row shape or dtype: DataError naming
    the first that differs. Variable-length rows: one segment of every file's rows (vlenload.py).
    """
    members = resolved.members
    infos = [m.info for m in members]
    paths = [m.ident.path for m in members]
    requested = resolve_dtype(req.dtype, "dtype")
    source_dtype = check_agreement(paths, infos, requested)
    total = sum(info.rows for info in infos)
    first = members[0].ident
    rows = Selection(req.mode, req.world_size, req.rank, req.span, req.rows).count(total)
    # variable-length rows: values estimated for the budget (each file's mean row length, by its
    # rows) until the load counts them
    mean = sum(info.mean_length * info.rows for info in infos) / max(total, 1)
    return SegmentMeta(
        source_path=first.path, source_dev=first.dev, source_ino=first.ino, source_size=first.size,
        source_mtime_ns=first.mtime_ns, key=req.key, mode=req.mode, world_size=req.world_size, rank=req.rank,
        total_rows=total, rows=rows,
        row_shape=infos[0].row_shape, dtype=storage_dtype(source_dtype, requested).str,
        source_dtype=source_dtype.str, span=req.span,
        files=tuple((*m.ident.as_tuple(), m.info.rows) for m in members), depends=_depends(resolved),
        vlen=infos[0].vlen, values=round(mean * rows) if infos[0].vlen else 0,
        start=req.rows[0] if req.rows else 0,
        # many s3:// objects: every one's ETag and version id, in the name (remoteload.py fetches them)
        remote=tuple(v for m in members if m.remote for v in (m.remote.etag, m.remote.version_id)),
    )


SMALL_PIECE_BYTES = 4 * 1024 * 1024  # a file's rows below this are read without rawcopy or a full inspection


def _quick_info(dset: h5py.Dataset | FieldRows, key: str) -> DatasetInfo:
    """``inspect_dataset``'s description of a dataset (or a field of one: compound.FieldRows)
    already inspected under the same identity."""
    chunks = dset.chunks
    rows = int(dset.shape[0])
    dtype, field = dset.dtype, ""
    extra: tuple[int, ...] = ()
    if isinstance(dset, FieldRows):  # the field's dtype; its own shape follows the dataset's dimensions
        sub = dset.dtype.fields[dset.field][0]
        dtype, extra, field = sub.base, tuple(int(n) for n in sub.shape), dset.field
    return DatasetInfo(key=key, rows=rows, row_shape=tuple(int(n) for n in (*dset.shape[1:], *extra)),
                       dtype=dtype.newbyteorder("="), chunk_rows=int(chunks[0]) if chunks else max(rows, 1),
                       chunked=bool(chunks), field=field)


def read_files_part(meta: SegmentMeta, rows: RowRange, writer: SegmentWriter, span: tuple[int, int] | None,
                    progress: Callable[[int], None], drop_page_cache: bool = False,
                    hashed: Hasher | None = None, *, virtual_ok: bool) -> int:
    """Read the shard's rows among global rows ``span`` (None: all), file by file, each file
    opened here (and checked to be the one resolved) and its rows pwritten into their place in
    the segment, passed to ``hashed`` in row order. With ``drop_page_cache`` each file's cached
    pages of the rows read are dropped once its rows are in. Returns the bytes copied file to file.

    Raised when a file is no longer the one resolved (replaced, rows changed): SourceChanged;
    when its rows cannot be read: DataError.
    """
    fd, base = writer.data_target()
    out_row = row_nbytes(meta.row_shape, meta.np_dtype)
    done = copied = 0
    for piece in pieces(rows, meta.file_rows, span):
        entry = meta.files[piece.index]
        small = (piece.k1 - piece.k0) * out_row < SMALL_PIECE_BYTES
        with open_h5_verified(entry) as f:
            # the resolver inspected this very file (same device and inode; size and mtime are
            # checked once the load is done): a small piece skips the full inspection
            # a compound field: read through the one-file path's helper; HDF5 follows an external
            # link by path: the file it opened must be one the daemon checked
            dset = pinned_rows(f, meta.key, (entry, *meta.depends), f"{entry[0]}[{meta.key}]", virtual_ok=virtual_ok)
            info = _quick_info(dset, meta.key) if small else inspect_dataset(f, meta.key)
            if info.rows != entry[5] or info.row_shape != meta.row_shape:
                raise SourceChanged(f"{entry[0]} changed while it was being loaded (dataset {meta.key!r} now has "
                                    f"{info.rows} rows of shape {info.row_shape}); request it again")
            # a small piece is read straight into the mapping: finding where its rows lie in the
            # file (to copy them file to file) costs more than reading them

            def piece_progress(n: int, before: int = done) -> None:
                progress(before + n)

            how = ShardWrite(None if small else (fd, base + piece.k0 * out_row), hashed)
            copied += read_shard_into(dset, info, piece.local, writer.data[piece.k0:piece.k1], piece_progress, how=how)
            if drop_page_cache:
                try:
                    extents = data_extents(dset, *piece.local.span)
                    if extents:
                        drop_cached(dset.file.id.get_vfd_handle(), extents)
                except Exception:  # noqa: BLE001, S110 - an optimisation: a file it cannot describe keeps its pages
                    pass
        done += piece.k1 - piece.k0
        progress(done)
    return copied
