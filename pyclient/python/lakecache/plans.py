"""Read plans (issue #35): a rank's reads for the rest of an epoch, sent
to the workers so that they evict by them (README, "Eviction by plan").
A plan that cannot be published is a warning, never an error in
training."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

from .shards import ShardInfo

Work = list[tuple[ShardInfo, int]]


def job_name(job: str | None = None) -> str:
    """The job part of plan names: `job`, `$LAKECACHE_JOB`, or `dataset`."""
    return job or os.environ.get("LAKECACHE_JOB", "dataset")


def publisher(
    fs: Any,
    name: str,
    ttl_s: int = 900,
    on_result: Callable[[dict], None] | None = None,
) -> Callable[[Work], None] | None:
    """For `TokenLoader(publish_plan=...)`: publishes the loader's
    remaining (shard, first token) reads as plan `name` (`job/rank`).
    None when `fs` does not read through a lakecache cluster."""
    client = getattr(fs, "client", None)
    if client is None or not hasattr(client, "publish_plan"):
        return None

    def publish(work: Work) -> None:
        entries = [
            (
                f"s3://{info.path}",
                info.data_offset + first * info.dtype.itemsize,
                info.data_offset + info.tokens * info.dtype.itemsize,
            )
            for info, first in work
            if first < info.tokens
        ]
        try:
            result = client.publish_plan(name, entries, ttl_s)
        except (OSError, ValueError) as e:
            warnings.warn(f"lakecache: publishing read plan {name} failed: {e}", stacklevel=2)
            return
        if on_result is not None:
            on_result(result)

    return publish
