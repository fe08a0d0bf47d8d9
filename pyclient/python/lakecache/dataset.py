"""A PyTorch IterableDataset of llm.c token shards, read through the
lakecache cluster client (no FUSE) or from a local/mounted directory.

Same semantics as the trainer's loader (it is the same code): each rank
reads a disjoint set of shards, in an order shuffled per (seed, epoch);
`state_dict()` / `load_state_dict()` resume mid-epoch.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils.data import IterableDataset

from . import plans
from .loader import TokenLoader
from .shards import list_shards


def _rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def resolve(uri: str, snapshot: str | None = None, **client: Any) -> tuple[Any, str]:
    """(fsspec filesystem or None, path) for `lakecache://bucket/prefix`
    or a local directory."""
    if uri.startswith(("lakecache://", "s3://")):
        from .fsspec_fs import LakecacheFileSystem

        path = LakecacheFileSystem._strip_protocol(uri)
        return LakecacheFileSystem(snapshot=snapshot, **client), path
    return None, uri


class TokenShardDataset(IterableDataset):
    """Yields `(x, y)` int64 batches of shape (micro_batch, seq_len), forever.

    Use it with `DataLoader(ds, batch_size=None, num_workers=0)`: reads
    already run on a background thread with the GIL released, and the
    client's runtime does not survive a fork into worker processes.
    """

    def __init__(
        self,
        uri: str,
        seq_len: int,
        micro_batch: int,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        snapshot: str | None = None,
        read_bytes: int = 16 << 20,
        fs: Any = None,
        plan_job: str | None = None,
        plan_ttl_s: int = 900,
        **client: Any,
    ) -> None:
        super().__init__()
        if fs is None:
            fs, path = resolve(uri, snapshot, **client)
        else:
            path = uri
        self.fs, self.path = fs, path
        r, w = _rank_and_world()
        self.rank = r if rank is None else rank
        self.world_size = w if world_size is None else world_size
        self.shards = list_shards(path, fs)
        self.seq_len, self.micro_batch, self.seed = seq_len, micro_batch, seed
        self.read_bytes = read_bytes
        # Reading through the cluster, each epoch's read order goes to the
        # workers as plan `{job}/{rank}` (README, "Eviction by plan").
        self.plan_job = plans.job_name(plan_job)
        self.plan_ttl_s = plan_ttl_s
        self.plan_result: dict | None = None  # the workers' last answer
        self._state: dict | None = None
        self._loader: TokenLoader | None = None

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        if info is not None and info.num_workers > 1:
            raise RuntimeError("TokenShardDataset reads on its own thread: use num_workers=0")
        loader = TokenLoader(
            self.shards,
            self.rank,
            self.world_size,
            self.seq_len,
            self.micro_batch,
            seed=self.seed,
            read_bytes=self.read_bytes,
            fs=self.fs,
            publish_plan=self._plan_publisher(),
            plan_renew_s=self.plan_ttl_s / 3,
        )
        if self._state is not None:
            loader.load_state_dict(self._state)
        self._loader = loader
        try:
            yield from loader
        finally:
            self._state = loader.state_dict()
            loader.close()

    def _plan_publisher(self):
        def keep(result: dict) -> None:
            self.plan_result = result

        name = f"{self.plan_job}/{self.rank}"
        return plans.publisher(self.fs, name, self.plan_ttl_s, on_result=keep)

    def state_dict(self) -> dict:
        """The position after the last batch handed out."""
        if self._loader is not None:
            return self._loader.state_dict()
        return dict(self._state or {"epoch": 0, "shard": 0, "token": 0, "plan": None})

    def load_state_dict(self, state: dict) -> None:
        self._state = dict(state)
