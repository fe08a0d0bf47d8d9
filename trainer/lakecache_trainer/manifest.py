"""Signed checkpoint manifests.

DeepSpeed's `load_checkpoint` unpickles its files, so a checkpoint that
someone else overwrote (through the cache, or in S3) can run code in the
trainer. Every saved checkpoint therefore gets `manifest.json`: the sha256
and size of each file, the tag, and an HMAC-SHA256 over all of it with a
key that does not live on the mount. A resume or export verifies the
manifest before DeepSpeed opens anything.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT = "lakecache-checkpoint-manifest-v1"
KEY_ENV = "LAKECACHE_CHECKPOINT_KEY_FILE"


class CheckpointRejected(SystemExit):
    """A checkpoint that must not be loaded; the message says why."""


def load_key(key_file: str | None, checkpoint_dir: str) -> bytes | None:
    """The signing key from `--checkpoint-key-file` or $LAKECACHE_CHECKPOINT_KEY_FILE.

    A key stored next to the checkpoints protects nothing: one on the same
    filesystem as the checkpoint directory is refused.
    """
    path = key_file or os.environ.get(KEY_ENV)
    if not path:
        return None
    try:
        key = Path(path).read_bytes().strip()
    except OSError as e:
        raise SystemExit(f"cannot read the checkpoint key {path}: {e.strerror}") from None
    if len(key) < 16:
        raise SystemExit(f"the checkpoint key in {path} is shorter than 16 bytes")
    ckpt = Path(checkpoint_dir)
    probe = ckpt if ckpt.exists() else ckpt.parent
    if probe.exists() and os.stat(path).st_dev == os.stat(probe).st_dev:
        raise SystemExit(
            f"the checkpoint key {path} is on the same filesystem as {checkpoint_dir}; "
            "keep it off the mount (e.g. a Kubernetes secret or the node's local disk)"
        )
    return key


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _files(tag_dir: Path) -> list[Path]:
    return sorted(p for p in tag_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def _body(tag: str, entries: list[dict]) -> bytes:
    return json.dumps(
        {"format": FORMAT, "tag": tag, "files": entries}, sort_keys=True, separators=(",", ":")
    ).encode()


def write(checkpoint_dir: str, tag: str, key: bytes) -> Path:
    """Hashes every file of the saved checkpoint and signs the list."""
    tag_dir = Path(checkpoint_dir) / tag
    entries = [
        {"path": p.relative_to(tag_dir).as_posix(), "size": p.stat().st_size, "sha256": _sha256(p)}
        for p in _files(tag_dir)
    ]
    body = _body(tag, entries)
    doc = {
        "format": FORMAT,
        "tag": tag,
        "files": entries,
        "hmac_sha256": hmac.new(key, body, hashlib.sha256).hexdigest(),
    }
    out = tag_dir / MANIFEST
    tmp = tag_dir / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return out


def verify(checkpoint_dir: str, tag: str, key: bytes | None, allow_unsigned: bool = False) -> None:
    """Raises CheckpointRejected unless the checkpoint is exactly what was signed."""
    where = f"{checkpoint_dir}/{tag}"
    if key is None:
        if allow_unsigned:
            return
        raise CheckpointRejected(
            f"refusing to load {where}: DeepSpeed unpickles checkpoint files, so only signed "
            f"checkpoints are loaded. Give the key they were saved with (--checkpoint-key-file "
            f"or ${KEY_ENV}), or pass --allow-unsigned-checkpoints if you trust every writer"
        )
    tag_dir = Path(checkpoint_dir) / tag
    try:
        doc = json.loads((tag_dir / MANIFEST).read_text())
        entries = doc["files"]
        body = _body(doc["tag"], entries)
        signature = doc["hmac_sha256"]
    except FileNotFoundError:
        raise CheckpointRejected(f"refusing to load {where}: it has no {MANIFEST}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointRejected(f"refusing to load {where}: malformed {MANIFEST} ({e})") from None
    expected = hmac.new(key, body, hashlib.sha256).hexdigest()
    if not isinstance(signature, str) or not hmac.compare_digest(signature, expected):
        raise CheckpointRejected(
            f"refusing to load {where}: its manifest is not signed with this checkpoint key "
            "(written by someone without the key, or with another key)"
        )
    if doc["tag"] != tag:
        raise CheckpointRejected(
            f"refusing to load {where}: its manifest was signed for tag {doc['tag']!r}"
        )
    listed = {e["path"]: e for e in entries}
    present = {p.relative_to(tag_dir).as_posix(): p for p in _files(tag_dir)}
    for extra in sorted(set(present) - set(listed)):
        raise CheckpointRejected(f"refusing to load {where}: {extra} is not in the signed manifest")
    for name, entry in sorted(listed.items()):
        path = present.get(name)
        if path is None:
            raise CheckpointRejected(f"refusing to load {where}: {name} is missing")
        if path.stat().st_size != entry["size"] or _sha256(path) != entry["sha256"]:
            raise CheckpointRejected(
                f"refusing to load {where}: {name} changed after it was saved (sha256 mismatch)"
            )
