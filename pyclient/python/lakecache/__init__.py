"""lakecache for Python without FUSE: the cluster client the mount uses
(PyO3 bindings), an fsspec filesystem (`lakecache://bucket/key`) and a
PyTorch IterableDataset of token shards."""

from ._native import Client, ObjectChangedError, SnapshotMismatchError

__all__ = ["Client", "ObjectChangedError", "SnapshotMismatchError"]
