"""The fields of a sample: which keys a dataset serves, and how a batch of them is returned.

A field is a key (a dataset, or ``"<dataset>:<field>"`` of a compound one: h5serve/hdf5/compound.py)
and how its rows come back: a requested dtype, a per-sample transform, and for byte strings
an encoding. Backends gather one column per field (one vectorised ``np.take`` each: a tensor,
or a NumPy array of byte strings); a ``FieldSet`` turns the columns into what the dataset
returns, in one of three layouts:

``xy``     ``x_key``/``y_key``, the predecessor's API: ``x`` or ``(x, y)`` samples, ``Batch`` /
           ``SampleList`` batches, ``transform``/``target_transform``.
``tuple``  ``keys=[...]``: samples and batches are tuples in the keys' order.
``dict``   ``keys={name: key}``: samples and batches are dicts with those names.

Without transforms a batch is the gathered columns, wrapped (``Batch``, ``TupleBatch``,
``DictBatch``) so that ``collate`` and ``default_collate`` return them as they are: no
per-sample objects, no second stack. ``default_collate`` recognises them through the type of
their rows (``BatchRow``, ``TupleRow``, ``DictRow``: torch's documented ``default_collate_fn_map``
hook, keyed on h5serve's own types only). With a transform, each sample is made and
transformed, and collated as usual.

Byte strings (``S16``) come as a list of ``bytes`` per batch (``str`` with ``encoding=``),
which is what ``default_collate`` makes of per-sample ``bytes`` too. Variable-length rows come
gathered as a ``RaggedColumn`` (h5serve/client/ragged.py), which ``Field.batch_column`` turns
into what ``ragged=`` names (a list of tensors, ``Padded``, a nested tensor; strings: a list
of ``str``) and ``Field.rows`` into one tensor (or ``str``) per row.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils.collate import default_collate

from ..errors import ConfigError, DataError
from ..hdf5.source import resolve_dtype
from . import ring
from ._process import register_collate
from .ragged import LIST, RaggedColumn, check_ragged, parse_ragged

__all__ = [
    "Field",
    "FieldSet",
    "parse_fields",
    "Batch",
    "BatchRow",
    "SampleList",
    "TupleBatch",
    "TupleRow",
    "DictBatch",
    "DictRow",
    "collate",
    "XY",
]

XY, TUPLE, DICT = "xy", "tuple", "dict"


# ----- the fields ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Field:
    """One field of a sample: ``name`` (the dict key; in messages), the HDF5 ``key``, the
    requested ``dtype`` (None: the source dtype), a per-sample ``transform`` and, for byte
    strings, the ``encoding`` that turns them into ``str`` (None: ``bytes``); for
    variable-length rows, the form of a batch (``ragged``: h5serve/client/ragged.py) and the
    ``pad_value`` of ``ragged="pad"``."""

    name: str
    key: str
    dtype: np.dtype | None = None
    transform: Callable[[Any], Any] | None = None
    encoding: str | None = None
    ragged: str = LIST
    pad_value: Any = 0

    def batch_column(self, column: torch.Tensor | np.ndarray | RaggedColumn) -> Any:
        """A gathered column as a batch returns it: the tensor, the byte strings as a list, or
        variable-length rows in the form ``ragged`` names.

        Raised when byte strings do not decode with ``encoding`` (variable-length strings:
        with their HDF5 encoding): DataError.
        """
        if isinstance(column, torch.Tensor):
            return column
        if isinstance(column, RaggedColumn):
            try:
                return column.batch(self.ragged, self.pad_value)
            except UnicodeDecodeError as exc:
                raise self._undecodable(exc, column.kind) from exc
        values = column.tolist()  # bytes, trailing NULs dropped (as h5py and numpy read them)
        if self.encoding is None:
            return values
        try:
            return _decode(values, self.encoding)
        except UnicodeDecodeError as exc:
            raise self._undecodable(exc, self.encoding) from exc

    def _undecodable(self, exc: UnicodeDecodeError, encoding: str) -> DataError:
        if encoding != self.encoding:  # variable-length strings: the encoding is the file's
            return DataError(
                f"key {self.key!r}: a row's bytes are not valid {encoding}, the encoding HDF5 records for these "
                f"variable-length strings ({exc.reason} at byte {exc.start}); the file was written with another "
                "encoding: rewrite the dataset with the right one"
            )
        return DataError(
            f"key {self.key!r}: a row's bytes are not valid {self.encoding} ({exc.reason} at byte {exc.start}); "
            "pass the encoding the file was written with, or leave encoding unset to get bytes"
        )

    def rows(self, column: torch.Tensor | np.ndarray | RaggedColumn) -> Sequence[Any]:
        """A gathered column as one value per row (tensor rows are views of the batch;
        variable-length rows: 1-D tensors, or ``str``, whatever ``ragged`` says)."""
        if isinstance(column, torch.Tensor):
            return column.unbind(0)
        if isinstance(column, RaggedColumn):
            try:
                return column.rows()
            except UnicodeDecodeError as exc:
                raise self._undecodable(exc, column.kind) from exc
        return self.batch_column(column)

    def apply(self, value: Any) -> Any:
        return value if self.transform is None else self.transform(value)


def _decode(values: list[Any], encoding: str) -> list[Any]:
    return [_decode(v, encoding) if isinstance(v, list) else v.decode(encoding) for v in values]


@dataclass(frozen=True)
class FieldSet:
    """A dataset's fields, in order, and the layout its samples and batches take."""

    fields: tuple[Field, ...]
    layout: str  # XY, TUPLE or DICT
    transformed: bool = field(init=False)  # any field has a transform

    def __post_init__(self) -> None:  # looked up once per batch: computed once here
        object.__setattr__(self, "transformed", any(f.transform is not None for f in self.fields))

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(f.key for f in self.fields)

    @property
    def dtypes(self) -> tuple[np.dtype | None, ...]:
        return tuple(f.dtype for f in self.fields)

    def transform_of(self, name: str) -> Callable[[Any], Any] | None:
        """The transform of x (``"x"``) or y (``"y"``) of an x/y dataset (None for others)."""
        if self.layout != XY:
            return None
        return next((f.transform for f in self.fields if f.name == name), None)

    def with_transform(self, name: str, fn: Callable[[Any], Any] | None) -> FieldSet:
        """This FieldSet with x's (``"x"``) or y's (``"y"``) transform replaced.

        Raised for a ``keys=`` dataset (its transforms are per field name), or y without a
        y_key: ConfigError.
        """
        if self.layout != XY:
            raise ConfigError("transform/target_transform belong to x_key/y_key datasets; this one has keys=: "
                              "pass transforms={name: fn} when creating it")
        if fn is not None and not callable(fn):
            raise ConfigError(f"a transform must be callable, got {type(fn).__name__}")
        if not any(f.name == name for f in self.fields):
            if fn is None:
                return self
            raise ConfigError("target_transform needs a y_key")
        return FieldSet(tuple(replace(f, transform=fn) if f.name == name else f for f in self.fields), self.layout)

    def _pack(self, values: Sequence[Any]) -> Any:
        if self.layout == DICT:
            return {f.name: v for f, v in zip(self.fields, values)}
        if self.layout == TUPLE or len(values) > 1:
            return tuple(values)
        return values[0]  # xy with x only

    def sample(self, columns: Sequence[torch.Tensor | np.ndarray | RaggedColumn]) -> Any:
        """The one sample of one-row ``columns``, transformed."""
        return self._pack([f.apply(f.rows(c)[0]) for f, c in zip(self.fields, columns)])

    def batch(self, columns: Sequence[torch.Tensor | np.ndarray | RaggedColumn]) -> Sequence[Any]:
        """What ``__getitems__`` returns for gathered ``columns``: the whole batch (for
        ``collate``/``default_collate`` to pass through), or per-sample results when a
        field has a transform."""
        if self.transformed:
            per_field = [f.rows(c) for f, c in zip(self.fields, columns)]
            return [self._pack([f.apply(v) for f, v in zip(self.fields, row)]) for row in zip(*per_field)]
        if self.layout == XY:  # the common case first, and cheaply (this runs once per batch)
            x = columns[0]
            if len(columns) == 1:
                if isinstance(x, torch.Tensor):
                    return SampleList(x)
            elif isinstance(x, torch.Tensor) and isinstance(columns[1], torch.Tensor):
                return Batch(x, columns[1])
        values = [f.batch_column(c) for f, c in zip(self.fields, columns)]
        if self.layout == DICT:
            return DictBatch({f.name: v for f, v in zip(self.fields, values)})
        if self.layout == TUPLE:
            return TupleBatch(tuple(values))
        tensors = all(isinstance(v, torch.Tensor) for v in values)
        if len(values) == 1:
            if isinstance(x, RaggedColumn):
                return ColumnSamples(self.fields[0].rows(x) if self.fields[0].ragged != LIST else values[0], values[0])
            return SampleList(values[0]) if tensors else values[0]  # bytes: already the list of rows
        return Batch(*values) if tensors else TupleBatch(tuple(values))

    def check_ragged(self, vlen_kinds: Sequence[str], out_dtypes: Sequence[np.dtype]) -> None:
        """Raised when ``ragged=``/``pad_value=`` ask for what no key has (no numeric
        variable-length key), or ``pad_value`` does not fit a key's dtype: ConfigError."""
        check_ragged(self.fields, self.keys, vlen_kinds, out_dtypes)

    def check_encoding(self, out_kinds: Sequence[str]) -> None:
        """Raised when ``encoding=`` was given but no key holds byte strings: ConfigError."""
        if any(f.encoding is not None for f in self.fields) and "S" not in out_kinds:
            raise ConfigError(
                f"encoding={self.fields[0].encoding!r} decodes byte string keys, but none of "
                f"{', '.join(repr(k) for k in self.keys)} holds byte strings; drop encoding="
            )


# ----- parsing the arguments ------------------------------------------------------------------
def _check_key(what: str, key: object) -> str:
    if not isinstance(key, str) or not key:
        raise ConfigError(f"{what} must be a non-empty string naming a dataset, got {key!r:.80}")
    return key


def _per_name(what: str, given: object, names: list[str]) -> dict[str, Any]:
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise ConfigError(f"{what} must be a dict of field name -> value (names: {', '.join(map(repr, names))}), "
                          f"got {type(given).__name__}")
    unknown = [n for n in given if n not in names]
    if unknown:
        raise ConfigError(f"{what} names {', '.join(map(repr, unknown))}, which is not among the fields "
                          f"{', '.join(map(repr, names))}")
    return dict(given)


def _check_encoding(encoding: object) -> str | None:
    if encoding is None:
        return None
    try:
        if not isinstance(encoding, str):
            raise LookupError
        codecs.lookup(encoding)
    except LookupError:
        raise ConfigError(f"encoding={encoding!r:.80} is not a text encoding Python knows; use e.g. 'utf-8' "
                          "or 'ascii'") from None
    return encoding


def parse_fields(
    x_key: object,
    y_key: object,
    keys: object,
    *,
    dtype_x: Any = None,
    dtype_y: Any = None,
    transform: Callable[[Any], Any] | None = None,
    target_transform: Callable[[Any], Any] | None = None,
    dtypes: object = None,
    transforms: object = None,
    encoding: object = None,
    ragged: object = LIST,
    pad_value: object = None,
) -> FieldSet:
    """The FieldSet of SharedH5Dataset's arguments: ``x_key``/``y_key`` (with ``dtype_x``,
    ``dtype_y``, ``transform``, ``target_transform``), or ``keys`` (with ``dtypes`` and
    ``transforms``, dicts by field name).

    Raised when they are mixed, missing, or malformed: ConfigError.
    """
    enc = _check_encoding(encoding)
    shape = parse_ragged(ragged, pad_value)
    if keys is None:
        if dtypes is not None or transforms is not None:
            raise ConfigError("dtypes= and transforms= go with keys=; with x_key/y_key use dtype_x/dtype_y and "
                              "transform/target_transform")
        if x_key is None:
            raise ConfigError("pass the key(s) to serve: x_key (and y_key), or keys=[...] / keys={name: key}")
        if isinstance(x_key, (list, tuple, dict)):
            raise ConfigError(f"x_key must be one key, got {type(x_key).__name__}; for several keys pass "
                              "keys=[...] (tuples) or keys={name: key} (dicts)")
        fields = [Field("x", _check_key("x_key", x_key), resolve_dtype(dtype_x, "dtype_x"), transform, enc, *shape)]
        if y_key is not None:
            fields.append(Field("y", _check_key("y_key", y_key), resolve_dtype(dtype_y, "dtype_y"),
                                target_transform, enc, *shape))
        elif dtype_y is not None or target_transform is not None:
            raise ConfigError("dtype_y and target_transform need a y_key")
        return FieldSet(tuple(fields), XY)
    mixed = [name for name, v in (("x_key", x_key), ("y_key", y_key), ("dtype_x", dtype_x), ("dtype_y", dtype_y),
                                   ("transform", transform), ("target_transform", target_transform)) if v is not None]
    if mixed:
        raise ConfigError(f"keys= replaces {', '.join(mixed)}: pass either keys= (with dtypes= and transforms=, "
                          "by field name) or x_key/y_key")
    if isinstance(keys, Mapping):
        layout = DICT
        pairs = list(keys.items())
        for name, _ in pairs:
            if not isinstance(name, str) or not name:
                raise ConfigError(f"keys={{name: key}} needs non-empty string names, got {name!r:.80}")
    elif isinstance(keys, (list, tuple)):
        layout = TUPLE
        pairs = [(k, k) for k in keys]
    else:
        raise ConfigError(f"keys must be a list of keys (tuple samples) or a dict of name -> key (dict samples), "
                          f"got {type(keys).__name__}")
    if not pairs:
        raise ConfigError("keys must name at least one dataset")
    for name, key in pairs:
        _check_key(f"key {name!r}" if layout == DICT else "each of keys", key)
    names = [name for name, _ in pairs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"keys lists {', '.join(map(repr, repeated))} more than once; name each key once")
    wanted = _per_name("dtypes", dtypes, names)
    steps = _per_name("transforms", transforms, names)
    for name, fn in steps.items():
        if fn is not None and not callable(fn):
            raise ConfigError(f"transforms[{name!r}] must be callable, got {type(fn).__name__}")
    named = tuple(
        Field(name, key, resolve_dtype(wanted.get(name), f"dtypes[{name!r}]"), steps.get(name), enc, *shape)
        for name, key in pairs
    )
    return FieldSet(named, layout)


# ----- batches --------------------------------------------------------------------------------
class BatchRow(tuple):
    """One ``(x[i], y[i])`` pair of a Batch: a plain tuple to everyone, and the type by which
    ``default_collate`` recognises a whole Batch (see ``_collate_rows``)."""

    __slots__ = ()


class Batch(Sequence):
    """What ``__getitems__`` returns for (x, y) data: the gathered batch tensors ``x`` and ``y``.

    ``collate`` returns them as they are (the fast path: no per-sample objects at all), and so
    does ``default_collate`` (as the list ``[x, y]``, its usual result for tuple samples): a
    plain DataLoader without ``collate_fn`` is as fast. Indexed, it is a sequence of
    per-sample ``(x[i], y[i])`` pairs, made on demand.
    """

    __slots__ = ("x", "y")

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x = x
        self.y = y

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return BatchRow((self.x[index], self.y[index]))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return map(BatchRow, zip(self.x.unbind(0), self.y.unbind(0)))


def _collate_rows(batch: Sequence[BatchRow], *, collate_fn_map: dict | None = None) -> list[Any]:
    """``default_collate`` of BatchRow samples: a whole Batch is ``[x, y]`` at once; rows
    gathered some other way are transposed and collated as tuples always are."""
    if isinstance(batch, Batch):
        return [batch.x, batch.y]
    return [default_collate(list(samples)) for samples in zip(*batch)]


class SampleList(list):
    """What ``__getitems__`` returns for x-only data: the per-sample rows as a real list
    (``default_collate`` stacks lists and tuples only), carrying the gathered tensor ``x``
    that ``collate`` returns without stacking again."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__(x.unbind(0))
        self.x = x
        self.y = None


class ColumnSamples(SampleList):
    """What ``__getitems__`` returns for x-only variable-length rows: the per-sample rows as a
    list (1-D tensors, or ``str``), carrying the batch ``x`` (in the form ``ragged=`` names)
    that ``collate`` returns. ``default_collate`` stacks the rows, as it does any samples:
    that needs rows of one length (or strings); use ``collate``, or ``keys=[...]``."""

    def __init__(self, rows: Sequence[Any], x: Any) -> None:  # noqa: D107 - no unbind: rows are given
        list.__init__(self, rows)
        self.x = x
        self.y = None


class TupleRow(tuple):
    """One sample of a TupleBatch: a plain tuple to everyone, and the type by which
    ``default_collate`` recognises a whole TupleBatch."""

    __slots__ = ()


class DictRow(dict):
    """One sample of a DictBatch: a plain dict to everyone, and the type by which
    ``default_collate`` recognises a whole DictBatch."""

    __slots__ = ()


def _length(value: Any) -> int:
    return value.shape[0] if isinstance(value, torch.Tensor) else len(value)


class TupleBatch(Sequence):
    """A batch of ``keys=[...]`` data: ``columns``, one per key in order (a tensor, or a list
    of byte strings). ``collate`` returns ``tuple(columns)``, ``default_collate`` the list
    (its result for tuple samples); indexed, per-sample tuples made on demand."""

    __slots__ = ("columns",)

    def __init__(self, columns: tuple[Any, ...]) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return _length(self.columns[0])

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return TupleRow(c[index] for c in self.columns)


class DictBatch(Sequence):
    """A batch of ``keys={name: key}`` data: ``columns`` by name (a tensor, or a list of byte
    strings). ``collate`` and ``default_collate`` return the dict; indexed, per-sample dicts
    made on demand."""

    __slots__ = ("columns",)

    def __init__(self, columns: dict[str, Any]) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return _length(next(iter(self.columns.values())))

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return DictRow((name, c[index]) for name, c in self.columns.items())


def _collate_tuple_rows(batch: Sequence[TupleRow], *, collate_fn_map: dict | None = None) -> list[Any]:
    if isinstance(batch, TupleBatch):
        return list(batch.columns)
    return [default_collate(list(samples)) for samples in zip(*batch)]


def _collate_dict_rows(batch: Sequence[DictRow], *, collate_fn_map: dict | None = None) -> dict[str, Any]:
    if isinstance(batch, DictBatch):
        return dict(batch.columns)
    return {name: default_collate([sample[name] for sample in batch]) for name in batch[0]}


register_collate({BatchRow: _collate_rows, TupleRow: _collate_tuple_rows, DictRow: _collate_dict_rows})


def collate(batch: Any) -> Any:
    """The ``collate_fn`` that goes with SharedH5Dataset: the gathered columns of a batch as
    they are (``x``, ``(x, y)``, a tuple for ``keys=[...]``, a dict for ``keys={...}``),
    anything else through ``default_collate``. In a make_loader worker, batches go through its
    ring (h5serve/client/ring.py) and arrive in the training process as those same tensors."""
    if isinstance(batch, Batch):
        return batch.x, batch.y
    if isinstance(batch, SampleList):
        return batch.x
    if isinstance(batch, TupleBatch):
        return tuple(batch.columns)
    if isinstance(batch, DictBatch):
        return dict(batch.columns)
    if isinstance(batch, ring.RingBatch):  # a make_loader worker's batch, in its ring slot
        return batch
    # in a make_loader worker, a transform's tensors are stacked straight into its ring
    return ring.collate(batch) or default_collate(batch)
