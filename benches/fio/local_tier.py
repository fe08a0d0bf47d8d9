#!/usr/bin/env python3
"""The node-local tier (L1) with FUSE passthrough against local disk, in
one session on one machine: local disk, mount cold (empty worker cache and
tier), L2-warm (worker cache warm, tier off) and L1-warm (tier whole,
page cache dropped); writes benches/results/local-tier.md.

Usage (as root, release binary built):
    python3 benches/fio/local_tier.py --bin target/release/lakecache
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import cpu
import provenance
import rounds
from run import HERE, Cluster, drop_caches, fio, remove_work


def wait_tier(tier: Path, objects: int) -> None:
    deadline = time.time() + 120
    while len(list(tier.glob("*.meta"))) < objects:
        if time.time() > deadline:
            raise SystemExit(f"the local tier in {tier} never held {objects} objects")
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--work", default="/var/tmp/lakecache-l1")
    ap.add_argument("--size", default="512M", help="per file, 4 files")
    ap.add_argument("--runtime", default="15")
    ap.add_argument("--out", default=str(HERE.parent / "results" / "local-tier.md"))
    ap.add_argument("--keep-work", action="store_true", help="keep --work after a good run")
    ap.add_argument("--tier-dir", help="local tier directory (default: under --work)")
    ap.add_argument("--cold-only", action="store_true", help="only the cold pair, no table")
    rounds.add_args(ap)
    a = ap.parse_args()
    rounds.check(a.rounds)
    work = Path(a.work)
    if work.exists():
        shutil.rmtree(work)
    (work / "local").mkdir(parents=True)
    tier = Path(a.tier_dir) if a.tier_dir else work / "tier"
    if tier.exists():
        shutil.rmtree(tier)
    plain = ("--insecure-http", "--no-auth")
    with_tier = ("--local-cache", str(tier), "--local-cache-size", "8GiB")
    tests = [
        (
            "seq read 256 KiB, 1 job",
            "seq-read.fio",
            {"size": a.size, "jobs": "1"},
            "mib_s",
        ),
        (
            "seq read 256 KiB, 4 jobs",
            "seq-read.fio",
            {"size": a.size, "jobs": "4"},
            "mib_s",
        ),
        (
            "rand read 4 KiB, 4 jobs",
            "rand-read.fio",
            {"size": a.size, "jobs": "4", "runtime": a.runtime},
            "iops",
        ),
    ]
    c = Cluster(a.bin, work)
    rows = []
    try:
        c.start_worker(fresh=True, worker_flags=plain)
        for d in (work / "local", c.mnt):
            fio("seq-read.fio", d, size=a.size, jobs="4")  # lays the files out
        c.stop_worker()
        # Cold 4-job sequential reads, without and with the tier filling.
        c.start_worker(fresh=True, worker_flags=plain)
        drop_caches()
        cold_plain = cpu.measured(
            lambda: fio("seq-read.fio", c.mnt, size=a.size, jobs="4"), c.daemons()
        )
        c.stop_worker()
        c.start_worker(fresh=True, worker_flags=plain, mount_flags=with_tier)
        drop_caches()
        cold_fill = cpu.measured(
            lambda: fio("seq-read.fio", c.mnt, size=a.size, jobs="4"), c.daemons()
        )
        time.sleep(2)
        held = sum(p.stat().st_blocks * 512 for p in tier.glob("*.data"))
        print(f"tier holds {held >> 20} MiB after the cold read", flush=True)
        c.stop_worker()
        print("cold", cold_plain["mib_s"], cold_fill["mib_s"], flush=True)
        if a.cold_only:
            return
        for name, job, env, unit in tests:

            def local_once(job=job, env=env) -> dict:
                drop_caches()
                return {"local": cpu.measured(lambda: fio(job, work / "local", **env))}

            def l2_once(job=job, env=env) -> dict:
                # L2-warm: the worker's cache only.
                c.start_worker(fresh=False, worker_flags=plain)
                drop_caches()
                r = cpu.measured(lambda: fio(job, c.mnt, **env), c.daemons())
                c.stop_worker()
                return {"l2": r}

            def l1_once(job=job, env=env) -> dict:
                # L1-warm: a new mount over the whole tier, passthrough.
                c.start_worker(fresh=False, worker_flags=plain, mount_flags=with_tier)
                drop_caches()
                r = cpu.measured(lambda: fio(job, c.mnt, **env), c.daemons())
                c.stop_worker()
                return {"l1": r}

            got = rounds.interleave(
                a.rounds, [("local", local_once), ("l2", l2_once), ("l1", l1_once)], name
            )
            rows.append((name, unit, got["local"], got["l2"], got["l1"]))
    finally:
        c.close()
    lines = [
        "# Node-local tier (L1, FUSE passthrough) vs local disk",
        "",
        *provenance.header(),
        (
            f"Machine: {os.cpu_count()} cores, `uname -r` {os.uname().release}. One s3-server, "
            "one worker (plain HTTP, no tokens) and one mount on this machine; 4 files of "
            f"{a.size}. Page cache dropped before every run. L2-warm = worker cache "
            "warm (a restarted worker), mount without a tier; L1-warm = a new mount over "
            "the whole tier, so opens get FUSE passthrough."
        ),
        "",
        (
            f"Each cell: the median of {a.rounds} interleaved rounds (lowest-highest); a "
            "ratio is the median of the per-round ratios to local disk in the same round. "
            "CPU-s/GiB: CPU time (user + system) of fio's jobs and of the lakecache worker and "
            "mount per GiB read, median over the rounds (the S3 endpoint left out)."
        ),
        "",
        "| test | unit | local disk | L2-warm | L1-warm | L2/local | L1/local |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, unit, local, l2, l1 in rows:
        u = "MiB/s" if unit == "mib_s" else "IOPS"
        lines.append(
            f"| {name} | {u} | {rounds.cell(local, unit)} | {rounds.cell(l2, unit)} | "
            f"{rounds.cell(l1, unit)} | {rounds.ratio_cell(l2, local, unit)} | "
            f"{rounds.ratio_cell(l1, local, unit)} |"
        )
    lines += [
        "",
        (
            "Cold 4-job sequential read (empty worker cache), one run each: "
            f"{cold_plain['mib_s']:.0f} MiB/s ({cold_plain['cpu_per_gib']:.2f} CPU-s/GiB) "
            f"without a tier, {cold_fill['mib_s']:.0f} MiB/s "
            f"({cold_fill['cpu_per_gib']:.2f} CPU-s/GiB) while filling the tier."
        ),
    ]
    provenance.write(a.out, lines)
    print(f"wrote {a.out}")
    if not a.keep_work:
        remove_work(work)


if __name__ == "__main__":
    sys.exit(main())
