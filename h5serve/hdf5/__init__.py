"""Reading HDF5 through h5py: identity and validation (source), rows into buffers and segment
files (reads), raw file-to-file copies (rawcopy), many files as one dataset (files), virtual
datasets (vds), variable-length rows (vlen) and fields of compound datasets (compound).

Shared by the daemon and the client; torch-free and daemon-free.
"""

__all__: list[str] = []  # import from the modules: h5serve.hdf5.source, .reads, ...
