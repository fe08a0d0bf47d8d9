#!/usr/bin/env python3
"""The node-local tier completing objects on its own (issue #31):

  stopped reader   a 2 GiB object read in file order up to 1 GiB, then
                   closed: seconds until the tier holds it whole with no
                   further reads, and the worker bytes it took;
  header + footer  the first and last 64 KiB of another 2 GiB object:
                   worker bytes fetched against the 128 KiB read;
  after            the first object read again: MiB/s and the mount's CPU
                   (whole, so FUSE passthrough serves it).

Also the mount's peak RSS against its --memory-limit. Writes
benches/results/tier-completion.md.

Usage (as root; a release build):
    python3 benches/fio/tier_completion.py --bin target/release/lakecache \
        --proxy target/release/delay-proxy
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import time
from pathlib import Path

import cpu
import provenance
from read_path import MEMORY_LIMIT, Setup, peak_rss, whole_objects, worker_metric
from run import HERE, drop_caches

GIB = 1 << 30


def served(s: Setup, baseline: bool = False) -> float:
    """Bytes the worker has served. The counter appears with its first
    bytes, so only a baseline may find it absent (0); a later read that
    finds none fails (a renamed metric must not read as 0)."""
    text = subprocess.run(
        ["curl", "-s", f"http://127.0.0.1:{s.worker_port}/metrics"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    present = any(ln.startswith("lakecache_served_bytes_total") for ln in text.splitlines())
    if not present and not baseline:
        raise SystemExit("the worker exports no lakecache_served_bytes_total")
    return worker_metric(s.worker_port, "lakecache_served_bytes_total", "", False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--proxy", required=True)
    ap.add_argument("--work", default="/var/tmp/lakecache-tier-completion")
    ap.add_argument("--deadline", type=float, default=120.0, help="seconds to wait for whole")
    ap.add_argument("--out", default=str(HERE.parent / "results" / "tier-completion.md"))
    a = ap.parse_args()
    work = Path(a.work)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    started = time.time()
    s = Setup(a, work, secure=False, rtt_ms=0)
    try:
        s.start_worker(fresh=True)
        s.start_mount(tier=False)
        for name in ("stopped.bin", "model.bin"):
            subprocess.run(
                [
                    "dd",
                    "if=/dev/urandom",
                    f"of={s.mnt / name}",
                    "bs=1M",
                    "count=2048",
                    "status=none",
                ],
                check=True,
            )
        s.stop_mount()
        s.start_mount(tier=True, fresh_tier=True)
        mount_pid = s.mount.pid if s.mount else 0
        drop_caches()

        before = served(s, baseline=True)
        with open(s.mnt / "stopped.bin", "rb", buffering=0) as f:
            left = GIB
            while left:
                got = f.read(min(left, 1 << 20))
                if not got:
                    raise SystemExit("stopped.bin ended early")
                left -= len(got)
        closed = time.monotonic()
        while whole_objects(s.tier) < 1:
            if time.monotonic() - closed > a.deadline:
                raise SystemExit(
                    f"stopped.bin not whole {a.deadline:.0f} s after its reader stopped"
                )
            time.sleep(0.1)
        to_whole = time.monotonic() - closed
        stopped_bytes = served(s) - before

        before = served(s)
        with open(s.mnt / "model.bin", "rb", buffering=0) as f:
            head = f.read(64 << 10)
            f.seek(-(64 << 10), 2)
            tail = f.read(64 << 10)
        if len(head) + len(tail) != 128 << 10:
            raise SystemExit("short header or footer read")
        hf_bytes = served(s) - before

        drop_caches()
        mount_before = cpu.process_seconds(mount_pid)
        t0 = time.perf_counter()
        moved = 0
        with open(s.mnt / "stopped.bin", "rb", buffering=0) as f:
            while chunk := f.read(1 << 20):
                moved += len(chunk)
        after_s = time.perf_counter() - t0
        mount_cpu = cpu.process_seconds(mount_pid) - mount_before
        rss = peak_rss(mount_pid)
    finally:
        s.close()
    lines = [
        "# Local tier: completion without reads, header-and-footer cost",
        "",
        *provenance.header(),
        f"One run; {time.time() - started:.0f} s in all. s3-server, worker and mount on this "
        "machine, plain HTTP, loopback S3; the objects were written through the mount "
        "just before (no tier), then the page cache dropped. Worker bytes: the worker's "
        "lakecache_served_bytes_total.",
        "",
        "| case | result |",
        "|---|---|",
        f"| 2 GiB object read in order to 1 GiB, reader closed: whole after | {to_whole:.1f} s "
        "(target: 30 s) |",
        f"| ... worker bytes from the first read to whole | {stopped_bytes / GIB:.3f} GiB "
        "(the object: 2 GiB) |",
        f"| first + last 64 KiB of a 2 GiB object: worker bytes | {hf_bytes / 1024:.0f} KiB "
        f"for 128 KiB read ({hf_bytes / (128 << 10):.2f}x; target: at most 2x) |",
        f"| the completed object read again (page cache dropped) | "
        f"{moved / after_s / (1 << 20):.0f} MiB/s; mount {mount_cpu / (moved / GIB):.3f} "
        "CPU-s/GiB |",
        f"| mount peak RSS (VmHWM) | {rss / (1 << 20):.0f} MiB, --memory-limit "
        f"{MEMORY_LIMIT >> 20} MiB |",
    ]
    text = "\n".join(lines) + "\n"
    Path(a.out).write_text(text)
    print(text)
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
