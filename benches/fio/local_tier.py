#!/usr/bin/env python3
"""The node-local tier (L1) with FUSE passthrough against local disk and
against s3fs with its local cache (`-o use_cache`, the fair peer for a
node-local tier), in one session on one machine: local disk, s3fs with a
warm cache, L2-warm (worker cache warm, tier off) and L1-warm (tier whole),
page cache dropped (and once hot); also the mount cold (empty worker cache
and tier). Writes benches/results/local-tier.md.

Usage (as root, release binary built; installs s3fs with apt):
    python3 benches/fio/local_tier.py --bin target/release/lakecache
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import cpu
import provenance
import rounds
from run import ACCESS, BUCKET, HERE, SECRET, Cluster, drop_caches, fio, mounted, remove_work


def install_s3fs() -> str:
    if not shutil.which("s3fs"):
        subprocess.run(["apt-get", "install", "-y", "-q", "s3fs"], check=True,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    out = subprocess.run(["s3fs", "--version"], capture_output=True, text=True, check=False)
    return (out.stdout or out.stderr).splitlines()[0].strip()


class S3fs:
    """s3fs mounted on the bench's S3 endpoint with its local cache on."""

    def __init__(self, c: Cluster, work: Path) -> None:
        self.c, self.work = c, work
        self.mnt, self.cache = work / "s3fs-mnt", work / "s3fs-cache"
        self.mnt.mkdir(exist_ok=True)
        self.cache.mkdir(exist_ok=True)
        self.passwd = work / "s3fs-passwd"
        self.passwd.write_text(f"{ACCESS}:{SECRET}\n")
        self.passwd.chmod(0o600)
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["s3fs", BUCKET, str(self.mnt), "-f", "-o",
             f"url=http://127.0.0.1:{self.c.s3_port},use_path_request_style,"
             f"passwd_file={self.passwd},endpoint=us-east-1,listobjectsv2,ro,"
             f"use_cache={self.cache}"],
            stdout=subprocess.DEVNULL, stderr=self.c.log("s3fs"))
        deadline = time.time() + 30
        while not mounted(self.mnt):
            if time.time() > deadline or self.proc.poll() is not None:
                raise SystemExit(f"s3fs did not mount; see {self.work / 's3fs.log'}")
            time.sleep(0.1)

    def stop(self) -> None:
        subprocess.run(["fusermount3", "-u", str(self.mnt)], check=False)
        if self.proc:
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


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
    # (name, fio job, fio env, unit, page cache hot)
    tests = [
        ("seq read 256 KiB, 1 job", "seq-read.fio", {"size": a.size, "jobs": "1"}, "mib_s",
         False),
        ("seq read 256 KiB, 4 jobs", "seq-read.fio", {"size": a.size, "jobs": "4"}, "mib_s",
         False),
        ("rand read 4 KiB, 4 jobs", "rand-read.fio",
         {"size": a.size, "jobs": "4", "runtime": a.runtime}, "iops", False),
        ("10,000 x 100 KiB files, 1 job", "small-files.fio", {}, "mib_s", False),
        ("seq read 256 KiB, 1 job, page cache hot", "seq-read-hot.fio",
         {"size": a.size, "jobs": "1"}, "mib_s", True),
    ]
    s3fs_version = install_s3fs()
    c = Cluster(a.bin, work)
    peer = S3fs(c, work)
    rows = []
    try:
        c.start_worker(fresh=True, worker_flags=plain)
        for d in (work / "local", c.mnt):
            fio("seq-read.fio", d, size=a.size, jobs="4")  # lays the files out
            (d / "small").mkdir(exist_ok=True)
            fio("small-files.fio", d)
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
        # The small files too, so that L1 holds every file whole.
        fio("small-files.fio", c.mnt)
        wait_tier(tier, 4 + 10_000)
        held = sum(p.stat().st_blocks * 512 for p in tier.glob("*.data"))
        print(f"tier holds {held >> 20} MiB after the cold reads", flush=True)
        c.stop_worker()
        print("cold", cold_plain["mib_s"], cold_fill["mib_s"], flush=True)
        if a.cold_only:
            return
        # s3fs's cache filled by one read of everything.
        peer.start()
        fio("seq-read.fio", peer.mnt, size=a.size, jobs="4")
        fio("small-files.fio", peer.mnt)
        peer.stop()
        for name, job, env, unit, hot in tests:

            def measure(directory: Path, pids: list[int], job=job, env=env, hot=hot) -> dict:
                if hot:
                    fio(job, directory, **env)  # the page cache filled
                else:
                    drop_caches()
                return cpu.measured(lambda: fio(job, directory, **env), pids)

            def local_once(measure=measure) -> dict:
                return {"local": measure(work / "local", [])}

            def s3fs_once(measure=measure) -> dict:
                peer.start()
                try:
                    pid = peer.proc.pid if peer.proc else 0
                    return {"s3fs": measure(peer.mnt, [pid])}
                finally:
                    peer.stop()

            def l2_once(measure=measure) -> dict:
                # L2-warm: the worker's cache only.
                c.start_worker(fresh=False, worker_flags=plain)
                r = measure(c.mnt, c.daemons())
                c.stop_worker()
                return {"l2": r}

            def l1_once(measure=measure) -> dict:
                # L1-warm: a new mount over the whole tier, passthrough.
                c.start_worker(fresh=False, worker_flags=plain, mount_flags=with_tier)
                r = measure(c.mnt, c.daemons())
                c.stop_worker()
                return {"l1": r}

            got = rounds.interleave(
                a.rounds,
                [("local", local_once), ("s3fs", s3fs_once), ("l2", l2_once),
                 ("l1", l1_once)],
                name,
            )
            rows.append((name, unit, got["local"], got["s3fs"], got["l2"], got["l1"]))
    finally:
        peer.stop()
        c.close()
    lines = [
        "# Node-local tier (L1, FUSE passthrough) vs local disk and s3fs with its cache",
        "",
        *provenance.header(),
        (
            f"Machine: {os.cpu_count()} cores, `uname -r` {os.uname().release}. One s3-server, "
            "one worker (plain HTTP, no tokens) and one mount on this machine; 4 files of "
            f"{a.size} and 10,000 files of 100 KiB. Page cache dropped before every run, "
            "except in the row marked hot (the job run once just before, unmeasured, and "
            "fio told not to drop the file's cached pages: `invalidate=0`). "
            f"s3fs = {s3fs_version} on the same S3 endpoint with `-o use_cache` (its "
            "cache filled by one earlier read of everything, kept across its remounts). "
            "L2-warm = worker cache warm (a restarted worker), mount without a tier; "
            "L1-warm = a new mount over the whole tier, so opens get FUSE passthrough."
        ),
        "",
        (
            f"Each cell: the median of {a.rounds} interleaved rounds (lowest-highest); a "
            "ratio is the median of the per-round ratios in the same round. "
            "CPU-s/GiB: CPU time (user + system) of fio's jobs and of the daemons (the "
            "lakecache worker and mount, or s3fs) per GiB read, median over the rounds (the "
            "S3 endpoint left out). Small files: MiB/s / 0.0977 = files/s."
        ),
        "",
        "| test | unit | local disk | s3fs (use_cache) | L2-warm | L1-warm | L2/local "
        "| L1/local | L1/s3fs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, unit, local, peer_r, l2, l1 in rows:
        u = "MiB/s" if unit == "mib_s" else "IOPS"
        lines.append(
            f"| {name} | {u} | {rounds.cell(local, unit)} | {rounds.cell(peer_r, unit)} | "
            f"{rounds.cell(l2, unit)} | {rounds.cell(l1, unit)} | "
            f"{rounds.ratio_cell(l2, local, unit)} | {rounds.ratio_cell(l1, local, unit)} | "
            f"{rounds.ratio_cell(l1, peer_r, unit)} |"
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
