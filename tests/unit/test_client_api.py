"""h5serve.client's surface: the core in ``__all__``, the predecessor's names in
h5serve.client.compat and still importable from h5serve.client, the daemon's client elsewhere."""

from __future__ import annotations

import importlib

import pytest

import h5serve.client as client
import h5serve.client.compat as compat

PREDECESSOR = {"RankMemCachedH5Dataset", "H5LazyDataset", "h5_worker_init_fn", "balanced_contiguous_shard",
               "interleaved_indices", "shard_indices"}


def test_all_is_the_core_with_the_batches_users_receive() -> None:
    assert {"SharedH5Dataset", "make_loader", "collate", "TupleBatch", "DictBatch", "StreamBatch",
            "LoaderStats", "StreamSampler", "H5ServeError"} <= set(client.__all__)
    assert not PREDECESSOR & set(client.__all__) and "DaemonClient" not in client.__all__
    for name in client.__all__:
        assert getattr(client, name) is not None


@pytest.mark.parametrize("name", sorted(PREDECESSOR))
def test_the_predecessors_names_import_from_client_and_compat(name: str) -> None:
    assert name in compat.__all__
    assert getattr(importlib.import_module("h5serve.client"), name) is getattr(compat, name)
    exec(f"from h5serve.client import {name}", {})  # noqa: S102 - the form users write


def test_daemon_client_from_client_warns_and_names_its_home() -> None:
    from h5serve.wire.connection import DaemonClient

    with pytest.warns(DeprecationWarning, match="h5serve.wire.connection"):
        assert client.DaemonClient is DaemonClient
    with pytest.raises(AttributeError):
        client.NoSuchName  # noqa: B018
