"""Reading HDF5 through h5py: which file a path names (identity), what a key names and whether
it can be served (source; links on its path: links; filters and storage: filters), rows into
buffers and segment files (reads), raw file-to-file copies (rawcopy), many files as one
dataset (files), virtual datasets (vds), variable-length rows (vlen) and fields of compound
datasets (compound).

Shared by the daemon and the client; torch-free and daemon-free.

May import: h5serve.wire (its limits on files and paths), h5serve.order, h5serve.util, h5serve.errors
"""

__all__: list[str] = []  # import from the modules: h5serve.hdf5.source, .reads, ...
