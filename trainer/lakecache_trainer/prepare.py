"""`lakecache-train prepare`: text files to byte-level token shards."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from .shards import encode_bytes, write_shard


def _documents(inputs: Iterable[str]) -> Iterator[bytes]:
    for path in inputs:
        p = Path(path)
        files = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
        for f in files:
            yield f.read_bytes()


def _synthetic(total_bytes: int, seed: int) -> Iterator[bytes]:
    """Text-like documents (words from a fixed vocabulary) for load tests."""
    rng = np.random.default_rng(seed)
    words = [
        bytes(rng.integers(97, 123, size=n, dtype=np.uint8)) for n in rng.integers(2, 10, 5000)
    ]
    made = 0
    while made < total_bytes:
        picks = rng.integers(0, len(words), size=20000)
        doc = b" ".join(words[i] for i in picks) + b".\n"
        made += len(doc)
        yield doc


def prepare(
    out_dir: str,
    inputs: list[str],
    shard_tokens: int,
    synthetic_bytes: int = 0,
    seed: int = 0,
) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    docs = _synthetic(synthetic_bytes, seed) if synthetic_bytes else _documents(inputs)
    written: list[str] = []
    pending: list[np.ndarray] = []
    count = 0

    def flush() -> None:
        nonlocal pending, count
        if not count:
            return
        path = os.path.join(out_dir, f"shard_{len(written):06d}.bin")
        write_shard(path, np.concatenate(pending)[:shard_tokens])
        written.append(path)
        rest = np.concatenate(pending)[shard_tokens:]
        pending, count = ([rest], len(rest)) if len(rest) else ([], 0)

    for doc in docs:
        toks = encode_bytes(doc)
        pending.append(toks)
        count += len(toks)
        while count >= shard_tokens:
            flush()
    flush()
    if not written:
        raise SystemExit("prepare: no input text")
    return written
