#!/usr/bin/env python3
"""The trainer's token shards read three ways in one session: through the
Python client (`lakecache://`, PyO3 over the cluster client, no FUSE),
through the FUSE mount, and from local disk; 1 and 4 reader threads, the
loader's access pattern (16 MiB sequential reads per shard). Writes
benches/results/pyclient-vs-mount.md.

Needs the `lakecache` Python package built in release mode
(`maturin develop --release` in pyclient/, or the wheel installed).

Usage (as root, release binary built):
    python3 benches/fio/pyclient_vs_mount.py --bin target/release/lakecache \\
        --work /var/tmp/lc-pyclient --shards 16 --shard-mib 64
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import provenance
from lakecache.fsspec_fs import LakecacheFileSystem
from lakecache.shards import open_shard, read_header, write_shard
from run import BUCKET, Cluster, drop_caches

READ = 16 << 20  # the trainer loader's read size


def read_all(paths: list[str], threads: int, fs: object = None) -> float:
    """MiB/s reading every shard whole, shards dealt round-robin to threads."""
    total = [0] * threads
    errors: list[BaseException] = []

    def reader(i: int) -> None:
        buf = bytearray(READ)
        try:
            for p in paths[i::threads]:
                read_header(p, fs)
                with open_shard(p, fs) as f:
                    while n := f.readinto(buf):
                        total[i] += n
        except BaseException as e:  # reported after the join
            errors.append(e)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=reader, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    return sum(total) / (1 << 20) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--work", default="/var/tmp/lc-pyclient")
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--shard-mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benches/results/pyclient-vs-mount.md")
    args = ap.parse_args()
    work = Path(args.work)
    subprocess.run(["rm", "-rf", str(work)], check=True)
    work.mkdir(parents=True)
    local = work / "local"
    local.mkdir()
    tokens = (args.shard_mib << 20) // 2 - 512
    rng = np.random.default_rng(0)
    for i in range(args.shards):
        write_shard(local / f"shard{i:03}.bin", rng.integers(0, 50257, tokens, dtype=np.uint32))
    c = Cluster(os.path.abspath(args.bin), work)
    rows: dict[tuple[str, int], list[float]] = {}
    try:
        c.start_worker(fresh=True)
        ds = c.mnt / "tokens"
        ds.mkdir()
        for p in sorted(local.iterdir()):
            shutil.copyfile(p, ds / p.name)
        names = sorted(p.name for p in local.iterdir())
        fs = LakecacheFileSystem(worker=f"127.0.0.1:{c.worker_port}")
        sources = {
            "local disk": ([str(local / n) for n in names], None),
            "FUSE mount": ([str(ds / n) for n in names], None),
            "Python client": ([f"{BUCKET}/tokens/{n}" for n in names], fs),
        }
        # Warm the worker (the cache is the point); every timed pass starts
        # with the kernel's page cache dropped, local disk included.
        read_all(sources["FUSE mount"][0], 4)
        for _ in range(args.repeats):
            for threads in (1, 4):
                for name, (paths, f) in sources.items():
                    drop_caches()
                    rows.setdefault((name, threads), []).append(read_all(paths, threads, f))
    finally:
        c.close()
    gib = args.shards * args.shard_mib / 1024
    lines = [
        "# Token shards through the Python client vs the FUSE mount vs local disk",
        "",
        *provenance.header(),
        "",
        f"{args.shards} llm.c shards of {args.shard_mib} MiB ({gib:.1f} GiB), read whole in "
        "16 MiB `readinto` calls (the trainer loader's pattern), shards dealt round-robin "
        "to the threads. One worker on loopback with the shards in its cache (warm); the "
        "kernel page cache is dropped before every pass, so local disk is read from the "
        f"device. Median of {args.repeats} passes, MiB/s.",
        "",
        "| source | 1 thread | 4 threads |",
        "|---|---:|---:|",
    ]
    med = {k: statistics.median(v) for k, v in rows.items()}
    for name in ("local disk", "FUSE mount", "Python client"):
        lines.append(f"| {name} | {med[(name, 1)]:.0f} | {med[(name, 4)]:.0f} |")
    lines += [
        "",
        "Ratios: Python client / mount "
        f"{med[('Python client', 1)] / med[('FUSE mount', 1)]:.2f} (1 thread), "
        f"{med[('Python client', 4)] / med[('FUSE mount', 4)]:.2f} (4 threads); "
        "Python client / local disk "
        f"{med[('Python client', 1)] / med[('local disk', 1)]:.2f} (1 thread), "
        f"{med[('Python client', 4)] / med[('local disk', 4)]:.2f} (4 threads).",
        "",
        "All passes (MiB/s): "
        + "; ".join(
            f"{n} x{t}: " + ", ".join(f"{v:.0f}" for v in vs) for (n, t), vs in sorted(rows.items())
        ),
        "",
    ]
    provenance.write(args.out, lines)


if __name__ == "__main__":
    main()
