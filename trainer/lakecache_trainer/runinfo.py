"""What a run was trained on, recorded in every checkpoint (`run.json`)
and at the top of the metrics file, and compared on resume.

The dataset is identified by its shards (name, size) and, when the run
reads a pinned snapshot, by the snapshot manifest's checksum. A resume
against different data refuses to start unless --allow-data-change.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lakecache.shards import HEADER_BYTES

RUN_FILE = "run.json"
SNAPSHOT_FORMAT = "lakecache-snapshot/1"


class DataChanged(SystemExit):
    """A resume against data that differs from the checkpoint's."""


def trainer_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lakecache-trainer")
    except PackageNotFoundError:
        return "0+source"


def load_snapshot(path: str, client: Any = None) -> dict:
    """A lakecache snapshot manifest (a local file, or s3:// read through
    `client`), its checksum checked the way `lakecache snapshot` computes
    it: SHA-256 of the compact JSON with `checksum` empty, fields in the
    order they were written."""
    try:
        if path.startswith(("s3://", "lakecache://")):
            if client is None:
                from lakecache.fsspec_fs import connect

                client = connect()
            size, etag, _ = client.stat(path)
            raw = client.read(path, 0, size, etag)
        else:
            raw = Path(path).read_bytes()
    except OSError as e:
        raise SystemExit(f"cannot read the snapshot manifest {path}: {e}") from None
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise SystemExit(f"{path}: not a snapshot manifest: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != SNAPSHOT_FORMAT:
        raise SystemExit(f"{path}: not a {SNAPSHOT_FORMAT} manifest")
    stated = doc.get("checksum", "")
    unsealed = {**doc, "checksum": ""}
    body = json.dumps(unsealed, separators=(",", ":"), ensure_ascii=False).encode()
    actual = hashlib.sha256(body).hexdigest()
    if actual != stated:
        raise SystemExit(
            f"{path}: manifest checksum mismatch: it says {stated}, its contents hash to "
            f"{actual} (edited or damaged)"
        )
    return doc


def shard_entries(infos: list) -> list[list]:
    """[name, bytes] of each shard (its header was checked against its size)."""
    return [[i.path.rsplit("/", 1)[-1], HEADER_BYTES + i.tokens * i.dtype.itemsize] for i in infos]


def check_against_snapshot(shards: list[list], snapshot: dict) -> None:
    """Every shard must be a manifest object of that name and size."""
    by_name: dict[str, list[int]] = {}
    for obj in snapshot["objects"]:
        by_name.setdefault(obj["key"].rsplit("/", 1)[-1], []).append(obj["size"])
    for name, size in shards:
        sizes = by_name.get(name)
        if not sizes:
            raise SystemExit(f"shard {name} is not in the snapshot manifest")
        if size not in sizes:
            raise SystemExit(
                f"shard {name} has {size} bytes; the snapshot records {sizes[0]} "
                "(the data directory is not the snapshot)"
            )


def dataset_identity(infos: list, snapshot: dict | None) -> dict:
    entries = shard_entries(infos)
    if snapshot is not None:
        check_against_snapshot(entries, snapshot)
    digest = hashlib.sha256(json.dumps(entries, separators=(",", ":")).encode()).hexdigest()
    return {
        "snapshot_checksum": snapshot["checksum"] if snapshot else None,
        "snapshot": f"s3://{snapshot['bucket']}/{snapshot['prefix']}" if snapshot else None,
        "shard_set_sha256": digest,
        "shards": entries,
    }


def run_record(cfg: Any, dataset: dict, world_size: int) -> dict:
    config = {k: v for k, v in asdict(cfg).items() if k not in ("crash_after_step",)}
    return {
        "trainer_version": trainer_version(),
        "config": config,
        "shard_order_seed": cfg.seed,
        "world_size": world_size,
        "dataset": dataset,
    }


def read_run(tag_dir: Path) -> dict | None:
    path = tag_dir / RUN_FILE
    if not path.exists():
        return None
    return json.loads(path.read_text())


def data_difference(saved: dict, current: dict) -> str | None:
    """One sentence on how the datasets differ, or None when they agree."""
    parts = []
    if saved.get("snapshot_checksum") != current.get("snapshot_checksum"):
        parts.append(
            f"snapshot {saved.get('snapshot_checksum') or '(none)'} -> "
            f"{current.get('snapshot_checksum') or '(none)'}"
        )
    old = {n: s for n, s in saved.get("shards", [])}
    new = {n: s for n, s in current.get("shards", [])}
    added = sorted(set(new) - set(old))
    removed = sorted(set(old) - set(new))
    resized = sorted(n for n in set(old) & set(new) if old[n] != new[n])
    for label, names in (("added", added), ("removed", removed), ("changed size", resized)):
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            parts.append(f"{len(names)} shard(s) {label}: {shown}")
    return "; ".join(parts) if parts else None


def config_difference(saved: dict, current: dict) -> list[str]:
    keys = ("model", "seq_len", "micro_batch", "grad_accum", "seed", "zero_stage")
    old, new = saved.get("config", {}), current.get("config", {})
    return [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def write_run(tag_dir: Path, record: dict) -> None:
    path = tag_dir / RUN_FILE
    tmp = tag_dir / (RUN_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
