"""A DLIO reader plugin that reads NPZ samples through lakecache's Python
client (the cluster client the mount uses, without FUSE).

DLIO still lists the dataset through `data_folder` (the mount); each file
DLIO opens is fetched whole with `Client.read` from the workers and
decoded in memory (the array a view of the fetched bytes: `npz.py`). Selected with
`++workload.reader.reader_classname=lakecache_reader.LakecacheNPZReader`
and configured by environment (DLIO passes no options to plugins):

- LAKECACHE_DLIO_ROOT: the directory DLIO reads (the mount point);
- LAKECACHE_DLIO_URI: the s3://bucket/prefix that directory shows;
- LAKECACHE_DLIO_WORKER: the worker's HOST:PORT;
- LAKECACHE_DLIO_COUNTS (optional): a directory where each process keeps
  the bytes it read in a file named by its pid (the bench's byte count:
  the client reads sockets with recv, which /proc/PID/io's rchar leaves
  out).
"""

from __future__ import annotations

import os
import sys

import lakecache
from dlio_benchmark.reader.npz_reader import NPZReader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import npz  # noqa: E402

_client: lakecache.Client | None = None
_read_bytes = 0


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise RuntimeError(f"{name} is not set; the lakecache DLIO reader needs it")
    return value


def client() -> lakecache.Client:
    """One client per process (DLIO's reader threads share it)."""
    global _client
    if _client is None:
        # With the mount's tier directory, reads share its node-local tier.
        tier = os.environ.get("LAKECACHE_DLIO_LOCAL_CACHE") or None
        _client = lakecache.Client(
            worker=_env("LAKECACHE_DLIO_WORKER"), threads=4, local_cache=tier
        )
    return _client


def uri_of(path: str) -> str:
    root = os.path.abspath(_env("LAKECACHE_DLIO_ROOT"))
    full = os.path.abspath(path)
    if not full.startswith(root + os.sep):
        raise ValueError(f"{path} is not under LAKECACHE_DLIO_ROOT {root}")
    base = _env("LAKECACHE_DLIO_URI").rstrip("/")
    return f"{base}/{os.path.relpath(full, root)}"


class LakecacheNPZReader(NPZReader):
    """NPZReader with the file's bytes from the cluster client."""

    def open(self, filename):
        # FormatReader's bookkeeping, without NPZReader's own np.load.
        super(NPZReader, self).open(filename)
        uri = uri_of(filename)
        c = client()
        size, etag, _ = c.stat(uri)
        data = c.read(uri, 0, size, etag)
        count(len(data))
        # A view of the client's bytes, not np.load's two more copies.
        return npz.array(data, "x")


def count(n: int) -> None:
    global _read_bytes
    _read_bytes += n
    counts = os.environ.get("LAKECACHE_DLIO_COUNTS")
    if counts:
        with open(os.path.join(counts, str(os.getpid())), "w") as f:
            f.write(str(_read_bytes))
