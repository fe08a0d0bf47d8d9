"""Checkpoint bookkeeping around DeepSpeed's save: durability before
`latest` moves, an optional wait for S3, and keeping the last K.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

TAG = re.compile(r"^step(\d+)$")


def fsync_tree(tag_dir: Path) -> int:
    """fsyncs every file under the tag and the directory itself. On a
    lakecache mount in write-back mode an fsync returns once the data is
    durable on the cache's replicas, so `latest` never names a checkpoint
    the cache could still lose."""
    n = 0
    for path in sorted(tag_dir.rglob("*")):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            n += 1
    fd = os.open(tag_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError:
        pass  # directories on some filesystems refuse fsync; the files are what count
    finally:
        os.close(fd)
    return n


def write_latest(ckpt_dir: str, tag: str) -> None:
    """The `latest` marker, written after every rank saved: a crash
    mid-save never points at a partial checkpoint."""
    tmp = os.path.join(ckpt_dir, "latest.tmp")
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(ckpt_dir, "latest"))


def s3_uri_of(path: Path) -> str:
    """The s3:// URI behind a path on a lakecache mount, from the mount's
    fsname (`lakecache:BUCKET/PREFIX`) in /proc/self/mountinfo."""
    real = path.resolve()
    best: tuple[Path, str] | None = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            point = Path(left.split()[4].replace("\\040", " "))
            fields = right.split()
            if len(fields) < 2 or not fields[1].startswith("lakecache:"):
                continue
            if (real == point or point in real.parents) and (
                best is None or len(str(point)) > len(str(best[0]))
            ):
                best = (point, fields[1].removeprefix("lakecache:"))
    if best is None:
        raise SystemExit(f"--checkpoint-sync s3: {path} is not on a lakecache mount")
    point, source = best
    bucket, _, prefix = source.partition("/")
    rel = real.relative_to(point).as_posix()
    key = "/".join(p for p in (prefix.strip("/"), rel if rel != "." else "") if p)
    return f"s3://{bucket}/{key}/"


def sync_to_s3(tag_dir: Path) -> None:
    """Waits until the cache has written the tag's files to S3."""
    binary = os.environ.get("LAKECACHE_BIN", "lakecache")
    uri = s3_uri_of(tag_dir)
    try:
        done = subprocess.run([binary, "sync", uri], capture_output=True, text=True)
    except OSError as e:
        raise SystemExit(f"--checkpoint-sync s3: cannot run {binary}: {e.strerror}") from None
    if done.returncode != 0:
        raise SystemExit(
            f"--checkpoint-sync s3: `lakecache sync {uri}` failed: "
            f"{done.stderr.strip() or done.stdout.strip()}"
        )


def prune(ckpt_dir: str, latest_tag: str, keep: int) -> list[str]:
    """Deletes step tags older than the `keep` newest, never `latest`
    itself or anything after it."""
    m = TAG.match(latest_tag)
    if keep <= 0 or m is None:
        return []
    latest_step = int(m.group(1))
    steps = sorted(
        int(t.group(1))
        for p in Path(ckpt_dir).iterdir()
        if p.is_dir() and (t := TAG.match(p.name)) and int(t.group(1)) <= latest_step
    )
    doomed = steps[: max(0, len(steps) - keep)]
    for step in doomed:
        shutil.rmtree(Path(ckpt_dir) / f"step{step}")
    return [f"step{s}" for s in doomed]
