"""What a dataset needs beyond HDF5's own code: its filters (a missing plugin named, with the
package that provides it) and where its rows are stored (raw external files are refused:
h5serve cannot track them for changes). Imports hdf5plugin when the ``filters`` extra is
installed, which registers its filters with HDF5 for this process.
"""

from __future__ import annotations

import h5py

from ..errors import UnsupportedDataset

__all__ = ["HAVE_HDF5PLUGIN", "HDF5PLUGIN_FILTERS", "KNOWN_FILTERS", "check_filters", "check_storage"]

# Registered ids of common third-party HDF5 filters, to name them when their plugin is missing.
KNOWN_FILTERS = {32001: "blosc", 32004: "lz4", 32008: "bitshuffle", 32015: "zstd", 32026: "blosc2", 307: "bzip2",
                 32013: "zfp", 32017: "sz", 32024: "sz3", 32018: "fcidecomp", 305: "lzo", 32002: "mafisc"}
# Filters the `filters` extra (hdf5plugin) provides: a missing one names the extra to install.
HDF5PLUGIN_FILTERS = frozenset({32001, 32004, 32008, 32015, 32026, 307, 32013, 32017, 32024, 32018})

try:  # registers blosc, zstd, lz4, bitshuffle, ... with HDF5 for this process
    import hdf5plugin  # noqa: F401

    HAVE_HDF5PLUGIN = True
except ImportError:
    HAVE_HDF5PLUGIN = False


def check_storage(obj: h5py.Dataset, key: str) -> None:
    """Raised when rows live in raw files outside HDF5 (external storage), whose changes
    h5serve cannot track: UnsupportedDataset. (Virtual datasets: vds.py.)"""
    external = obj.external
    if external:
        names = ", ".join(str(entry[0]) for entry in external)
        raise UnsupportedDataset(
            f"dataset {key!r} keeps its rows in external raw files ({names}), which h5serve cannot track for "
            "changes; copy the rows into a dataset stored inside the HDF5 file"
        )


def check_filters(obj: h5py.Dataset, key: str) -> None:
    """Raised when a filter the dataset needs is not available here: UnsupportedDataset."""
    plist = obj.id.get_create_plist()
    for i in range(plist.get_nfilters()):
        filter_id, _flags, _values, raw_name = plist.get_filter(i)
        if not h5py.h5z.filter_avail(filter_id):
            name = KNOWN_FILTERS.get(filter_id) or raw_name.decode(errors="replace") or "unknown"
            if filter_id in HDF5PLUGIN_FILTERS and not HAVE_HDF5PLUGIN:
                fix = "install the filters extra: pip install 'h5serve[filters]' (hdf5plugin)"
            else:
                fix = "install an HDF5 plugin for it (see HDF5_PLUGIN_PATH) or rewrite the dataset with gzip/lzf"
            raise UnsupportedDataset(
                f"dataset {key!r} is compressed with HDF5 filter {name!r} (id {filter_id}), which is not "
                f"available here; {fix}"
            )
