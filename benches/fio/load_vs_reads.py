#!/usr/bin/env python3
"""A large `lakecache load` and a reader on the same worker: cold 8 MiB
reads through the mount while the worker is idle and while it preloads
GiBs, in one session; writes benches/results/load-vs-reads.md.

Usage (as root, release binary built):
    python3 benches/fio/load_vs_reads.py --bin target/release/lakecache \\
        --work /var/tmp/lc-load --gib 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path

import provenance
from run import BUCKET, Cluster, drop_caches

HOT_FILES, HOT_MIB, BULK_FILE_MIB = 24, 8, 256


def cli(c: Cluster, *args: str) -> subprocess.CompletedProcess:
    worker = f"127.0.0.1:{c.worker_port}"
    return subprocess.run(
        [c.bin, *args, "--worker", worker], env=c.env, capture_output=True, text=True, check=True
    )


def cold_read(path: Path) -> float:
    drop_caches()
    t = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 20):
            pass
    return time.perf_counter() - t


def job_running(c: Cluster, job: str) -> bool:
    url = f"http://127.0.0.1:{c.worker_port}/v1/load/{job}"
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.load(resp)["state"] == "running"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--work", default="/var/tmp/lc-load")
    ap.add_argument("--gib", type=int, default=6)
    args = ap.parse_args()
    work = Path(args.work)
    subprocess.run(["rm", "-rf", str(work)], check=True)
    work.mkdir(parents=True)
    c = Cluster(os.path.abspath(args.bin), work)
    try:
        c.start_worker(fresh=True)
        mnt = c.mnt
        (mnt / "bulk").mkdir()
        (mnt / "hot").mkdir()
        block = os.urandom(1 << 20)
        for i in range(args.gib * 1024 // BULK_FILE_MIB):
            with open(mnt / "bulk" / f"{i:03}.bin", "wb") as f:
                for _ in range(BULK_FILE_MIB):
                    f.write(block)
        for i in range(HOT_FILES):
            (mnt / "hot" / f"{i:02}.bin").write_bytes(os.urandom(HOT_MIB << 20))
        # Everything cold: only S3 has the bytes.
        cli(c, "free", f"s3://{BUCKET}/")

        idle = [cold_read(mnt / "hot" / f"{i:02}.bin") for i in range(HOT_FILES // 2)]
        job = "bench-load"
        started = time.perf_counter()
        cli(c, "load", f"s3://{BUCKET}/bulk/", "--id", job, "--background")
        time.sleep(2)  # let it reach full speed
        during, while_running = [], []
        for i in range(HOT_FILES // 2, HOT_FILES):
            during.append(cold_read(mnt / "hot" / f"{i:02}.bin"))
            while_running.append(job_running(c, job))
        done = subprocess.run(
            [c.bin, "load", "status", job, "--wait", "--worker", f"127.0.0.1:{c.worker_port}"],
            env=c.env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        load_s = time.perf_counter() - started
    finally:
        c.close()

    def ms(xs: list[float]) -> str:
        xs = sorted(xs)
        p90 = xs[int(len(xs) * 0.9) - 1]
        return f"{statistics.median(xs) * 1000:.0f} / {p90 * 1000:.0f} / {xs[-1] * 1000:.0f}"

    gib = args.gib
    summary = done.stdout.strip().splitlines()[-1]
    result = {
        "load_gib": gib,
        "load_seconds": round(load_s, 1),
        "idle_ms": [round(x * 1000) for x in idle],
        "during_ms": [round(x * 1000) for x in during],
        "reads_finished_while_load_running": sum(while_running),
    }
    out = Path(__file__).resolve().parents[1] / "results" / "load-vs-reads.md"
    head = "\n".join(provenance.header())
    text = (
        f"""# A large preload and a reader on the same worker

{head}
(release build, this 2-core machine, the embedded S3 endpoint on loopback, one
worker, the mount; every read is cold: `lakecache free` first, kernel caches dropped
before each read).

`lakecache load s3://{BUCKET}/bulk/` fetches {gib} GiB ({gib * 1024 // BULK_FILE_MIB} objects of
{BULK_FILE_MIB} MiB) into the worker; meanwhile the mount reads {HOT_FILES // 2} other
objects of {HOT_MIB} MiB, each cold.

| | cold {HOT_MIB} MiB read, median / p90 / max (ms) |
|---|---|
| worker idle | {ms(idle)} |
| during the load | {ms(during)} |

- Reads that finished while the load was still running: {sum(while_running)} of {len(during)}.
- The load: {summary} ({load_s:.0f} s in all, {gib * 1024 / load_s:.0f} MiB/s).
- Preload fetches use 8 slots of their own per worker; the reads share the machine's
  2 cores and one disk with the load, so they slow down but are never queued behind it.

```json
{json.dumps(result, indent=2)}
```
"""
    )
    provenance.write(out, text.splitlines())


if __name__ == "__main__":
    main()
