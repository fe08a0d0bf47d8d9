"""Streams training batches from token shards.

Each rank reads a disjoint set of shards, in an order shuffled per
(seed, epoch), with large sequential reads on a background thread and a
bounded prefetch queue. The position of the last batch handed out is the
loader state that goes into checkpoints.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from .shards import ShardError, ShardInfo, open_shard, read_header


@dataclass
class LoaderState:
    epoch: int = 0
    shard: int = 0  # index into this rank's work list for the epoch
    token: int = 0  # next token to read inside that shard
    # After a resume on another world size: this rank's share of what the
    # epoch had left, as [global shard index, first token]; None for an
    # ordinary epoch (this rank's slice of the epoch's permutation).
    plan: list[list[int]] | None = None


def reshard(
    states: list[dict], old_world: int, new_world: int, n_shards: int, seed: int
) -> list[dict]:
    """Loader states for `new_world` ranks that finish the epoch the old
    ranks were in, each remaining piece of it read by exactly one new rank.

    Deterministic: the remainder is taken old rank by old rank, in each
    rank's own order, and dealt round-robin. Old ranks already in a later
    epoch count as having finished the earliest one (what they read of
    the next epoch is read again).
    """
    if len(states) != old_world:
        raise ValueError(f"{len(states)} loader states for {old_world} ranks")
    epoch = min(int(s["epoch"]) for s in states)
    rest: list[list[int]] = []
    for rank, s in enumerate(states):
        if int(s["epoch"]) != epoch:
            continue
        work = s.get("plan")
        if work is None:
            perm = np.random.default_rng([seed, epoch]).permutation(n_shards)
            work = [[int(i), 0] for i in perm[rank::old_world]]
        for k, (idx, first) in enumerate(work[int(s["shard"]) :]):
            start = int(s["token"]) if k == 0 and int(s["token"]) else int(first)
            rest.append([int(idx), start])
    return [
        asdict(LoaderState(epoch=epoch, shard=0, token=0, plan=rest[r::new_world]))
        for r in range(new_world)
    ]


class TokenLoader:
    def __init__(
        self,
        shards: list[str],
        rank: int,
        world_size: int,
        seq_len: int,
        micro_batch: int,
        seed: int = 0,
        read_bytes: int = 16 << 20,
        prefetch: int = 8,
        fs: Any = None,
        publish_plan: Callable[[list[tuple[ShardInfo, int]]], None] | None = None,
        plan_renew_s: float = 300.0,
    ) -> None:
        if len(shards) < world_size:
            raise ShardError(
                f"{len(shards)} shards for {world_size} ranks: each rank needs its own shard"
            )
        self.fs = fs  # None: local paths (a mount); else an fsspec filesystem
        self.infos: list[ShardInfo] = [read_header(p, fs) for p in shards]
        need = seq_len * micro_batch + 1
        short = [i.path for i in self.infos if i.tokens < need]
        if short:
            raise ShardError(f"{short[0]}: fewer than the {need} tokens one batch needs")
        self.rank, self.world_size = rank, world_size
        self.seq_len, self.micro_batch = seq_len, micro_batch
        self.seed, self.read_bytes, self.prefetch = seed, read_bytes, prefetch
        self.state = LoaderState()
        self.wait_seconds = 0.0  # data wait of the last next()
        self.bytes_read = 0
        # Called with this rank's remaining reads (shard, first token) at
        # each epoch's start and every `plan_renew_s` within it (issue
        # #35: the cache evicts and prefetches by them).
        self.publish_plan = publish_plan
        self.plan_renew_s = plan_renew_s
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def order(self, epoch: int) -> list[ShardInfo]:
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.infos))
        return [self.infos[i] for i in perm[self.rank :: self.world_size]]

    def work(self, pos: LoaderState) -> list[tuple[ShardInfo, int]]:
        """This rank's shards for `pos.epoch`, each with its first token."""
        if pos.plan is not None:
            return [(self.infos[i], first) for i, first in pos.plan]
        return [(info, 0) for info in self.order(pos.epoch)]

    def state_dict(self) -> dict:
        return asdict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self.state = LoaderState(**state)

    def _start(self) -> None:
        self._stop.clear()
        self._queue = queue.Queue(maxsize=self.prefetch)
        start = LoaderState(**asdict(self.state))
        self._thread = threading.Thread(
            target=self._produce, args=(start, self._queue, self._stop), daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get_nowait()
            except queue.Empty:
                self._thread.join(timeout=0.05)
        self._thread = None

    def __iter__(self) -> TokenLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._thread is None:
            self._start()
        t0 = time.perf_counter()
        item = self._queue.get()
        self.wait_seconds = time.perf_counter() - t0
        if isinstance(item, BaseException):
            self.close()
            raise item
        x, y, state = item
        self.state = state
        return x, y

    def _produce(self, pos: LoaderState, out: queue.Queue, stop: threading.Event) -> None:
        batch_tokens = self.seq_len * self.micro_batch
        published: tuple[int, float] | None = None  # (epoch, when)
        try:
            while not stop.is_set():
                shards = self.work(pos)
                if pos.shard >= len(shards):
                    pos = LoaderState(epoch=pos.epoch + 1)
                    continue
                info, first = shards[pos.shard]
                start = pos.token or first
                if self.publish_plan is not None and (
                    published is None
                    or published[0] != pos.epoch
                    or time.monotonic() - published[1] >= self.plan_renew_s
                ):
                    self.publish_plan([(info, start), *shards[pos.shard + 1 :]])
                    published = (pos.epoch, time.monotonic())
                for x, y, token in self._batches(info, start, batch_tokens, stop):
                    state = LoaderState(pos.epoch, pos.shard, token, pos.plan)
                    while not stop.is_set():
                        try:
                            out.put((x, y, state), timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
                pos = LoaderState(pos.epoch, pos.shard + 1, 0, pos.plan)
        except BaseException as e:  # handed to the training loop
            out.put(e if isinstance(e, ShardError) else ShardError(f"reading shards failed: {e}"))

    def _batches(self, info: ShardInfo, token: int, batch_tokens: int, stop: threading.Event):
        """Batches from `token` on, read in large sequential chunks."""
        itemsize = info.dtype.itemsize
        chunk_tokens = max(self.read_bytes // itemsize, batch_tokens + 1)
        buf = np.empty(0, dtype=info.dtype)
        try:
            f = open_shard(info.path, self.fs)
        except OSError as e:
            raise ShardError(f"{info.path}: cannot open: {e}") from e
        with f:
            f.seek(info.data_offset + token * itemsize)
            next_read = token + len(buf)
            while not stop.is_set():
                while len(buf) < batch_tokens + 1 and next_read < info.tokens:
                    want = min(chunk_tokens, info.tokens - next_read)
                    raw = bytearray(want * itemsize)
                    try:
                        n = f.readinto(raw)
                    except OSError as e:
                        raise ShardError(f"{info.path}: read failed: {e}") from e
                    if n != len(raw):
                        raise ShardError(
                            f"{info.path}: truncated: expected {len(raw)} bytes at token "
                            f"{next_read}, got {n}"
                        )
                    self.bytes_read += n
                    buf = np.concatenate([buf, np.frombuffer(raw, dtype=info.dtype)])
                    next_read += want
                if len(buf) < batch_tokens + 1:
                    return  # the shard's tail is shorter than a batch
                window = torch.from_numpy(buf[: batch_tokens + 1].astype(np.int64))
                x = window[:-1].view(self.micro_batch, self.seq_len)
                y = window[1:].view(self.micro_batch, self.seq_len)
                buf = buf[batch_tokens:]
                token += batch_tokens
                yield x, y, token
