#!/usr/bin/env python3
"""Why a 4-job read swings between about 1.1 and 3.4 GB/s on this VM,
whatever is read (local disk or the node-local tier through passthrough).

The VM returns free guest memory to its host (virtio-balloon free page
reporting, /sys/module/page_reporting). A page the host took back costs a
host fault the next time the guest touches it, so a read into the page
cache is slow when the free memory it lands in was reported, and fast
when that memory was freed a moment before. Which case a run gets depends
on what ran before it, not on what it reads.

This bench reads the same 4 x --size files, 4 fio jobs, page cache dropped
before each run, in a fixed sequence:

  L1 fresh   a new mount over a tier just filled (as read_path.py's
             L1-warm does it: cold read, L2 read, fill, remount)
  L1 again   the same, after one more remount
  local      the files on local disk
  ... then the three again, each after waiting until page reporting has
  gone quiet (every free page handed back, so each run pays first touch).

Beside MiB/s: fio's own CPU seconds (the kernel copying into the pages).
Writes benches/results/first-touch.md.

Usage (as root, after read_path.py laid its datasets out in --work):
    python3 benches/fio/first_touch.py --bin target/release/lakecache \
        --proxy target/release/delay-proxy
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import provenance
from read_path import Setup, fill_tier
from run import HERE, drop_caches, fio

REPORTED = Path("/sys/module/page_reporting/parameters/reported_kib")


def settle(quiet_s: float = 3.0, limit_s: float = 60.0) -> float:
    """Waits until free page reporting has been quiet for `quiet_s`;
    returns the seconds waited."""
    start = since = time.monotonic()
    last = REPORTED.read_text()
    while time.monotonic() - start < limit_s:
        time.sleep(0.5)
        now = REPORTED.read_text()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return time.monotonic() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--proxy", required=True, help="the delay-proxy binary (unused: RTT 0)")
    ap.add_argument("--work", default="/var/tmp/lakecache-readpath",
                    help="read_path.py's --work, with its datasets laid out")
    ap.add_argument("--size", default="512M")
    ap.add_argument("--out", default=str(HERE.parent / "results" / "first-touch.md"))
    a = ap.parse_args()
    if not REPORTED.exists():
        raise SystemExit(f"{REPORTED} is missing: this machine does not report free pages")
    work = Path(a.work)
    if not (work / "laid-out").exists():
        raise SystemExit(f"run read_path.py --work {work} first (it lays the datasets out)")
    a.rtt_ms = 0
    s = Setup(a, work, True, 0)
    files = [f"seq.{i}" for i in range(4)]
    rows = []

    def read(where: Path, label: str, settled: bool) -> None:
        drop_caches()
        waited = settle() if settled else 0.0
        r = fio("seq-read.fio", where, size=a.size, jobs="4")
        rows.append((label, settled, r["mib_s"], r["fio_cpu_s"], waited))
        print(f"{label} (settled: {settled}): {r['mib_s']:.0f} MiB/s, "
              f"fio {r['fio_cpu_s']:.2f} CPU-s", flush=True)

    try:
        for settled in (False, True):
            s.start_worker(fresh=True)
            s.start_mount(tier=True, fresh_tier=True)
            drop_caches()
            fio("seq-read.fio", s.mnt, size=a.size, jobs="4")  # cold, filling
            s.stop_mount()
            s.start_mount(tier=False)
            drop_caches()
            fio("seq-read.fio", s.mnt, size=a.size, jobs="4")  # L2
            s.stop_mount()
            s.start_mount(tier=True)
            fill_tier(s, [s.mnt / f for f in files])
            s.stop_mount()
            for label in ("L1 fresh", "L1 again"):
                s.start_mount(tier=True)
                read(s.mnt, label, settled)
                s.stop_mount()
            read(work / "local", "local", settled)
            s.stop(s.worker)
    finally:
        s.close()
    lines = [
        "# First touch of reported memory: why 4-job reads swing on this VM",
        "",
        *provenance.header(),
        "4 fio jobs read 4 files of " + a.size + " each, page cache dropped before every "
        "run. \"settled\": before the run, waited until /sys/module/page_reporting had "
        "reported every free page to the host (quiet for 3 s). fio CPU: its jobs' user + "
        "system seconds, almost all of it copying into page cache pages.",
        "",
        "| run | settled | MiB/s | fio CPU-s | waited s |",
        "|---|---|---|---|---|",
    ]
    for label, settled, mib_s, cpu_s, waited in rows:
        lines.append(f"| {label} | {'yes' if settled else 'no'} | {mib_s:.0f} | "
                     f"{cpu_s:.2f} | {waited:.0f} |")
    provenance.write(a.out, lines)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
