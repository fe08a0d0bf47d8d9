"""The trainer's loader is `lakecache.loader`: one implementation of the
per-rank, per-epoch shard order for the mount and the Python client."""

from lakecache.loader import LoaderState, TokenLoader, reshard

__all__ = ["LoaderState", "TokenLoader", "reshard"]
