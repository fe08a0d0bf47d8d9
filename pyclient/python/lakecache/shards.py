"""Token shards in the llm.c format: a 256 x int32 header, then tokens.

Header: [magic, version, token count, 0...]. Version 1 (magic 20240520)
holds uint16 tokens, version 7 (magic 20240801) uint32 tokens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
FORMATS = {
    (20240520, 1): np.dtype("<u2"),
    (20240801, 7): np.dtype("<u4"),
}
# Byte-level tokenizer: one token per byte, plus end-of-text.
EOT = 256
VOCAB_SIZE = 257


class ShardError(Exception):
    """A shard that cannot be used; the message names the file."""


@dataclass(frozen=True)
class ShardInfo:
    path: str
    tokens: int
    dtype: np.dtype

    @property
    def data_offset(self) -> int:
        return HEADER_BYTES


def open_shard(path: str, fs: Any = None) -> Any:
    """An unbuffered binary file: local, or from an fsspec filesystem."""
    if fs is None:
        return open(path, "rb", buffering=0)  # noqa: SIM115 (the caller closes it)
    return fs.open(path, "rb", cache_type="none")


def read_header(path: str | os.PathLike[str], fs: Any = None) -> ShardInfo:
    path = str(path)
    try:
        with open_shard(path, fs) as f:
            raw = f.read(HEADER_BYTES)
            size = os.fstat(f.fileno()).st_size if fs is None else f.size
    except OSError as e:
        raise ShardError(f"{path}: cannot read: {e}") from e
    if len(raw) < HEADER_BYTES:
        raise ShardError(f"{path}: truncated header ({len(raw)} of {HEADER_BYTES} bytes)")
    header = np.frombuffer(raw, dtype="<i4")
    magic, version, count = int(header[0]), int(header[1]), int(header[2])
    dtype = FORMATS.get((magic, version))
    if dtype is None:
        raise ShardError(
            f"{path}: not an llm.c token shard (magic {magic}, version {version}; "
            f"expected one of {sorted(FORMATS)})"
        )
    want = HEADER_BYTES + count * dtype.itemsize
    if size != want:
        raise ShardError(
            f"{path}: header says {count} tokens ({want} bytes) but the file has {size} bytes"
        )
    return ShardInfo(path=path, tokens=count, dtype=dtype)


def write_shard(path: str | os.PathLike[str], tokens: np.ndarray) -> None:
    """Writes a shard; uint16 when every token fits, else uint32."""
    tokens = np.asarray(tokens)
    if tokens.size and int(tokens.max()) >= 1 << 16:
        magic, version, dtype = 20240801, 7, np.dtype("<u4")
    else:
        magic, version, dtype = 20240520, 1, np.dtype("<u2")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = magic, version, tokens.size
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(dtype, copy=False).tobytes())


def list_shards(directory: str | os.PathLike[str], fs: Any = None) -> list[str]:
    if fs is not None:
        try:
            names = [e["name"] for e in fs.ls(str(directory), detail=True) if e["type"] == "file"]
        except FileNotFoundError:
            raise ShardError(f"{directory}: dataset prefix does not exist") from None
        except OSError as e:
            raise ShardError(f"{directory}: cannot list: {e}") from e
        shards = sorted(n for n in names if n.endswith(".bin"))
        if not shards:
            raise ShardError(f"{directory}: no .bin shards")
        return shards
    d = Path(directory)
    if not d.is_dir():
        raise ShardError(f"{d}: dataset directory does not exist")
    shards = sorted(str(p) for p in d.iterdir() if p.suffix == ".bin")
    if not shards:
        raise ShardError(f"{d}: no .bin shards")
    return shards


def encode_bytes(text: bytes) -> np.ndarray:
    """Byte-level tokens of a document, terminated by EOT."""
    out = np.empty(len(text) + 1, dtype=np.uint16)
    out[:-1] = np.frombuffer(text, dtype=np.uint8)
    out[-1] = EOT
    return out
