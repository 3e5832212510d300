"""A member's training process (tests/integration/test_isolation.py): maps a shared daemon's
segments in the main process and in DataLoader workers started with spawn, and prints what
each got as JSON. Run as a throwaway user with tests/users.py's public_interpreter."""

from __future__ import annotations

import json
import sys
import warnings

import torch
from torch.utils.data import DataLoader, Dataset

from h5serve.client import SharedH5Dataset


class Probe(Dataset):
    """Each item: the backend of the process that read it, and the row's bytes."""

    def __init__(self, ds: SharedH5Dataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> tuple[str, list[int]]:
        return self.ds.backend, self.ds.__getitems__([i]).x.numpy().ravel().tolist()


def identity(item: object) -> object:
    return item


def main() -> None:
    path, runtime_dir, daemon_user = sys.argv[1:4]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = SharedH5Dataset(path, "x", runtime_dir=runtime_dir, daemon_user=daemon_user, fallback="error")
        loader = DataLoader(Probe(ds), batch_size=None, sampler=[0, 1, 998, 999], num_workers=2,
                            multiprocessing_context="spawn", collate_fn=identity)
        items = list(loader)
    torch.set_num_threads(1)
    print(json.dumps({"main": ds.backend, "workers": sorted({backend for backend, _ in items}),
                      "rows": [row for _, row in items], "warnings": [str(w.message) for w in caught]}))


if __name__ == "__main__":
    main()
