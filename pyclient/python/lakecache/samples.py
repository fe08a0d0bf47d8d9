"""Map-style data sets with samplers (issue #35): fixed-size records read
through the cluster client, and a sampler wrapper that publishes each
epoch's read order to the workers as a plan before the epoch starts, so
that they fetch ahead of the loader and evict by it.

    ds = RecordDataset(uris, record_bytes=1 << 20, worker=..., token_file=...)
    sampler = PlannedSampler(DistributedSampler(ds, shuffle=True), ds)
    loader = DataLoader(ds, batch_size=8, sampler=sampler, num_workers=4,
                        multiprocessing_context="spawn")
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in loader: ...

The sampler runs in the main process (DataLoader asks it for indices), so
one process publishes each rank's plan; the data set opens its own client
in each loader worker process. Loader workers must start by spawn (or
forkserver): a client does not survive a fork, and the data set says so
instead of hanging.
"""

from __future__ import annotations

import bisect
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

from . import plans
from ._native import Client


class RecordDataset(Dataset):
    """Record `i` is `record_bytes` bytes of one of `uris` (`s3://bucket/key`):
    each object holds its records back to back after `header_bytes`, and a
    partial record at an object's end is left out. Items are the records'
    bytes (or `transform(bytes)`); objects are pinned to the versions seen
    when the data set was made."""

    def __init__(
        self,
        uris: Sequence[str],
        record_bytes: int,
        header_bytes: int = 0,
        transform: Any = None,
        **client: Any,
    ) -> None:
        super().__init__()
        if record_bytes <= 0:
            raise ValueError(f"record_bytes is {record_bytes}; it must be positive")
        if header_bytes < 0:
            raise ValueError(f"header_bytes is {header_bytes}; it must not be negative")
        self.record_bytes, self.header_bytes = record_bytes, header_bytes
        self.transform = transform
        self._client_args = client
        self._client: Client | None = None
        self._pid = -1
        self.objects: list[tuple[str, str]] = []  # (uri, etag)
        self._firsts: list[int] = []  # each object's first record
        count = 0
        for uri in uris:
            size, etag, _ = self.client().stat(uri)
            records = max(0, size - header_bytes) // record_bytes
            if records == 0:
                continue
            self.objects.append((uri, etag))
            self._firsts.append(count)
            count += records
        self._len = count

    def client(self) -> Client:
        """This process's client. A process forked from one holding a
        client cannot make its own (the parent's runtime threads are not
        there, and locks they held stay held): use DataLoader workers that
        start by spawn, which get the settings and open a client."""
        if self._client is not None and self._pid != os.getpid():
            raise RuntimeError(
                "RecordDataset in a forked process: create the DataLoader with "
                "multiprocessing_context='spawn' (or 'forkserver')"
            )
        if self._client is None:
            self._client = Client(**self._client_args)
            self._pid = os.getpid()
        return self._client

    def __getstate__(self) -> dict:
        # Loader workers started by spawn get the settings, not the client.
        state = dict(self.__dict__)
        state["_client"], state["_pid"] = None, -1
        return state

    def __len__(self) -> int:
        return self._len

    def _locate(self, i: int) -> tuple[int, int]:
        if not 0 <= i < self._len:
            raise IndexError(f"record {i} of {self._len}")
        obj = bisect.bisect_right(self._firsts, i) - 1
        return obj, self.header_bytes + (i - self._firsts[obj]) * self.record_bytes

    def sample_range(self, i: int) -> tuple[str, int, int]:
        """(uri, start, end) of record `i`: what a plan lists for it."""
        obj, start = self._locate(i)
        return self.objects[obj][0], start, start + self.record_bytes

    def __getitem__(self, i: int) -> Any:
        obj, start = self._locate(int(i))
        uri, etag = self.objects[obj]
        data = self.client().read(uri, start, start + self.record_bytes, etag)
        return self.transform(data) if self.transform is not None else data


class PlannedSampler(Sampler[int]):
    """Wraps `sampler` (e.g. DistributedSampler or RandomSampler): each time
    an epoch's indices are drawn, publishes the ranges they read (through
    `dataset.sample_range`) as plan `JOB/RANK`, and publishes what is left
    again every `ttl_s / 3` seconds within the epoch so the plan never
    expires under a running job. A plan that cannot be published is a
    warning; the indices come all the same.

    Where the wrapped sampler's order follows from its epoch (it has
    `set_epoch` and `epoch`, as DistributedSampler does), the plan runs on
    into the next epoch's order (`plan_next_epoch`), so the end of one
    epoch already keeps and fetches what the next starts with. A plan too
    long for the workers' limit is published for this epoch alone."""

    def __init__(
        self,
        sampler: Any,
        dataset: Any,
        job: str | None = None,
        rank: int | None = None,
        ttl_s: int = 900,
        plan_next_epoch: bool = True,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s is {ttl_s}; it must be positive")
        self.sampler, self.dataset, self.ttl_s = sampler, dataset, ttl_s
        self.plan_next_epoch = plan_next_epoch
        if rank is None:
            rank = getattr(sampler, "rank", None)
        if rank is None:
            from .dataset import _rank_and_world

            rank = _rank_and_world()[0]
        self.name = f"{plans.job_name(job)}/{rank}"
        self.plan_result: dict | None = None  # the workers' last answer

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[int]:
        order = [int(i) for i in self.sampler]
        following = self._next_epoch_order()
        self._publish(order, following)
        published = time.monotonic()
        for at, index in enumerate(order):
            if time.monotonic() - published >= self.ttl_s / 3:
                self._publish(order[at:], following)
                published = time.monotonic()
            yield index

    def _next_epoch_order(self) -> list[int]:
        """The next epoch's indices, where the sampler's epoch decides them;
        the sampler is left at its own epoch."""
        epoch = getattr(self.sampler, "epoch", None)
        if not self.plan_next_epoch or not isinstance(epoch, int):
            return []
        if not hasattr(self.sampler, "set_epoch"):
            return []
        self.sampler.set_epoch(epoch + 1)
        try:
            return [int(i) for i in self.sampler]
        finally:
            self.sampler.set_epoch(epoch)

    def _publish(self, order: list[int], following: list[int]) -> None:
        client = self.dataset.client()
        if following:
            # The longer plan first; past the workers' limit, this epoch's.
            entries = [self.dataset.sample_range(i) for i in order + following]
            try:
                self.plan_result = client.publish_plan(self.name, entries, self.ttl_s)
                return
            except ValueError:
                pass
            except OSError as e:
                self._warn(e)
                return
        entries = [self.dataset.sample_range(i) for i in order]
        try:
            self.plan_result = client.publish_plan(self.name, entries, self.ttl_s)
        except (OSError, ValueError) as e:
            self._warn(e)

    def _warn(self, e: Exception) -> None:
        warnings.warn(f"lakecache: publishing read plan {self.name} failed: {e}", stacklevel=4)


def records_to_tensor(data: bytes) -> torch.Tensor:
    """A record's bytes as a uint8 tensor (a `transform` for RecordDataset)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
