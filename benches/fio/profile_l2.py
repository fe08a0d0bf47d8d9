#!/usr/bin/env python3
"""Where the CPU goes on the L2-warm path: a whole-system `perf` profile of
one sequential fio job through the mount (TLS and tokens on, worker cache
warm, no local tier, page cache dropped); writes
benches/results/read-path-profile.md.

Usage (as root; release binaries built, perf installed):
    python3 benches/fio/profile_l2.py --bin target/release/lakecache \
        --proxy target/release/delay-proxy
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import provenance
from read_path import Setup
from run import HERE, drop_caches, fio


def report(data: Path, sort: str, limit: int) -> list[str]:
    out = subprocess.run(
        ["perf", "report", "-i", str(data), "--no-children", "-g", "none", "--sort", sort,
         "--stdio", "--percent-limit", "1"],
        capture_output=True, text=True, check=False,
    ).stdout
    rows = [ln for ln in out.splitlines() if ln.strip() and not ln.startswith("#")]
    return rows[:limit]


def pids() -> str:
    """Which pid is which lakecache process (for reading the report)."""
    out = subprocess.run(["pgrep", "-a", "-f", "lakecache|fio"], capture_output=True,
                         text=True, check=False).stdout
    return "; ".join(" ".join(line.split()[:3]) for line in out.splitlines())


def profiled(data: Path, run) -> dict:
    """Runs `run()` under a whole-system perf recording into `data`."""
    perf = subprocess.Popen(
        ["perf", "record", "-a", "-F", "999", "-g", "-o", str(data)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        result = run()
        result["pids"] = pids()
        return result
    finally:
        perf.send_signal(2)
        perf.wait(timeout=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--proxy", required=True)
    ap.add_argument("--work", default="/var/tmp/lakecache-profile")
    ap.add_argument("--size", default="1G")
    ap.add_argument("--out", default=str(HERE.parent / "results" / "read-path-profile.md"))
    a = ap.parse_args()
    work = Path(a.work)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    s = Setup(a, work, True, 0)
    try:
        s.start_worker(fresh=True)
        s.start_mount(tier=False)
        fio("seq-read.fio", s.mnt, size=a.size, jobs="1")  # lays the file out
        fio("seq-read.fio", s.mnt, size=a.size, jobs="1")  # warms the worker
        s.stop_mount()
        s.start_mount(tier=False)
        drop_caches()
        data = work / "perf.data"
        result = profiled(data, lambda: fio("seq-read.fio", s.mnt, size=a.size, jobs="1"))
        # The cold path too: empty worker cache, the tier on and filling.
        s.stop_mount()
        s.stop(s.worker)
        s.start_worker(fresh=True)
        s.start_mount(tier=True, fresh_tier=True)
        drop_caches()
        cold_data = work / "perf-cold.data"
        cold = profiled(cold_data, lambda: fio("seq-read.fio", s.mnt, size=a.size, jobs="1"))
    finally:
        s.close()
    # Processes by pid (their threads share the name tokio-rt-worker);
    # the release binary is stripped, so user code shows by dso only.
    by_comm = report(data, "pid,dso", 16)
    by_sym = report(data, "pid,sym", 30)
    cold_comm = report(cold_data, "pid,dso", 16)
    cold_sym = report(cold_data, "pid,sym", 20)
    lines = [
        "# L2-warm read path: where the CPU goes",
        "",
        *provenance.header(),
        f"Machine: {os.cpu_count()} cores, `uname -r` {os.uname().release}. One fio job, "
        "sequential 256 KiB reads of one file through the mount; HTTPS and tokens between "
        "mount and worker; worker cache warm; no local tier; page cache dropped. "
        f"`perf record -a -F 999 -g` over the run: {result['mib_s']:.0f} MiB/s. "
        f"Processes: {result['pids']}.",
        "",
        "## By process (share of all samples, both cores)",
        "",
        "```",
        *by_comm,
        "```",
        "",
        "## By process and symbol (top entries)",
        "",
        "```",
        *by_sym,
        "```",
        "",
        f"## Cold (empty worker cache, tier filling): {cold['mib_s']:.0f} MiB/s",
        "",
        f"Processes: {cold['pids']}.",
        "",
        "```",
        *cold_comm,
        "```",
        "",
        "```",
        *cold_sym,
        "```",
    ]
    provenance.write(a.out, lines)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
