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
from dataclasses import asdict, dataclass

import numpy as np
import torch

from .shards import ShardError, ShardInfo, read_header


@dataclass
class LoaderState:
    epoch: int = 0
    shard: int = 0  # index into this rank's shard order for the epoch
    token: int = 0  # next token to read inside that shard


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
    ) -> None:
        if len(shards) < world_size:
            raise ShardError(
                f"{len(shards)} shards for {world_size} ranks: each rank needs its own shard"
            )
        self.infos: list[ShardInfo] = [read_header(p) for p in shards]
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
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def order(self, epoch: int) -> list[ShardInfo]:
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.infos))
        return [self.infos[i] for i in perm[self.rank :: self.world_size]]

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
        try:
            while not stop.is_set():
                shards = self.order(pos.epoch)
                if pos.shard >= len(shards):
                    pos = LoaderState(epoch=pos.epoch + 1)
                    continue
                info = shards[pos.shard]
                for x, y, token in self._batches(info, pos.token, batch_tokens, stop):
                    state = LoaderState(pos.epoch, pos.shard, token)
                    while not stop.is_set():
                        try:
                            out.put((x, y, state), timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
                pos = LoaderState(pos.epoch, pos.shard + 1, 0)
        except BaseException as e:  # handed to the training loop
            out.put(e if isinstance(e, ShardError) else ShardError(f"reading shards failed: {e}"))

    def _batches(self, info: ShardInfo, token: int, batch_tokens: int, stop: threading.Event):
        """Batches from `token` on, read in large sequential chunks."""
        itemsize = info.dtype.itemsize
        chunk_tokens = max(self.read_bytes // itemsize, batch_tokens + 1)
        buf = np.empty(0, dtype=info.dtype)
        try:
            f = open(info.path, "rb", buffering=0)
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
