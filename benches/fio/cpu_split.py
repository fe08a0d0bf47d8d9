#!/usr/bin/env python3
"""Sequential reads through lakecache, with the CPU time of each process
(worker, mount, S3 endpoint, delay proxy) per GiB read, for one or more
builds side by side in interleaved rounds: the A/B check for a change on
the read path. Two states: cold (empty worker cache and tier, S3 behind
--rtt-ms of round trip, the tier on as `up` runs it) and warm (worker
cache warm, page cache dropped, no tier, S3 on loopback). TLS and tokens
on. Prints one line per run and the medians; writes nothing else.

Usage (as root; datasets as read_path.py lays them out under --work):
    python3 benches/fio/cpu_split.py --bin old=/tmp/lakecache-old \
        --bin new=target/release/lakecache --proxy target/release/delay-proxy

A build named NAME=PATH,http reads every byte over HTTP (the mount gets
no local worker socket), to compare against short-circuit reads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from pathlib import Path

from read_path import Setup
from run import HERE, drop_caches


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Build:
    def __init__(self, binary: str, proxy: str, http_only: bool) -> None:
        self.bin, self.proxy, self.http_only = binary, proxy, http_only


def one_run(build: Build, work: Path, state: str, jobs: int, rtt_ms: int) -> dict[str, float]:
    cold = state == "cold"
    if build.http_only:
        os.environ["LAKECACHE_BENCH_HTTP_READS"] = "1"
    else:
        os.environ.pop("LAKECACHE_BENCH_HTTP_READS", None)
    setup = Setup(build, work, True, rtt_ms if cold else 0)
    try:
        setup.start_worker(fresh=True)
        setup.start_mount(tier=cold, fresh_tier=True)
        env = {
            **os.environ,
            "LAKECACHE_FIO_DIR": str(setup.mnt),
            "LAKECACHE_FIO_SIZE": "512M",
            "LAKECACHE_FIO_JOBS": str(jobs),
            "LAKECACHE_FIO_RUNTIME": "10",
        }
        job = str(HERE / "seq-read.fio")
        if not cold:
            subprocess.run(
                ["fio", "--output-format=json", job],
                env=env,
                capture_output=True,
                check=True,
            )
            setup.stop_mount()
            setup.start_mount(tier=False)
        drop_caches()
        pids = {
            "worker": setup.worker.pid,
            "mount": setup.mount.pid,
            "endpoint": setup.s3.pid,
        }
        for p in setup.procs:
            if "delay-proxy" in " ".join(map(str, p.args)):
                pids["proxy"] = p.pid
        before = {k: cpu_seconds(p) for k, p in pids.items()}
        out = subprocess.run(
            ["fio", "--output-format=json", job],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        spent = {k: cpu_seconds(p) - before[k] for k, p in pids.items()}
        runs = json.loads(out.stdout[out.stdout.index("{") :])["jobs"]
        read = sum(j["read"]["io_bytes"] for j in runs)
        secs = sum(j["read"]["runtime"] for j in runs) / len(runs) / 1000
        gib = read / 2**30
        row = {"MiB/s": read / 2**20 / secs}
        row.update({f"{k} CPU-s/GiB": v / gib for k, v in spent.items()})
        return row
    finally:
        setup.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", action="append", required=True, help="NAME=PATH of a lakecache build")
    ap.add_argument("--proxy", required=True, help="the delay-proxy binary")
    ap.add_argument("--work", default="/var/tmp/lakecache-readpath")
    ap.add_argument("--rtt-ms", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default="cold:1,cold:4,warm:1,warm:4",
                    help="STATE:JOBS,... to run (states: cold, warm)")
    a = ap.parse_args()
    builds = {}
    for spec in a.bin:
        name, _, path = spec.partition("=")
        path, _, mode = path.partition(",")
        if not path or not Path(path).is_file() or mode not in ("", "http"):
            raise SystemExit(f"--bin wants NAME=PATH[,http] of a built lakecache, got {spec!r}")
        builds[name] = Build(path, a.proxy, mode == "http")
    if a.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    try:
        cases = [(st, int(j)) for st, _, j in (c.partition(":") for c in a.cases.split(","))]
    except ValueError:
        raise SystemExit(f"--cases wants STATE:JOBS,..., got {a.cases!r}") from None
    if not cases or any(st not in ("cold", "warm") or j < 1 for st, j in cases):
        raise SystemExit(f"--cases wants cold or warm and JOBS >= 1, got {a.cases!r}")
    results: dict[tuple[str, str, int], list[dict[str, float]]] = {}
    for r in range(a.rounds):
        for name, build in builds.items():
            for state, jobs in cases:
                row = one_run(build, Path(a.work), state, jobs, a.rtt_ms)
                results.setdefault((name, state, jobs), []).append(row)
                cells = ", ".join(
                    f"{k} {v:.2f}" if "CPU" in k else f"{k} {v:.0f}" for k, v in row.items()
                )
                print(f"round {r + 1} {name} {state} {jobs} job(s): {cells}", flush=True)
    print(
        f"\nmedians of {a.rounds} rounds (cold: S3 at {a.rtt_ms} ms RTT, tier on; "
        "warm: worker cache warm, page cache dropped)"
    )
    for (name, state, jobs), rows in results.items():
        cells = ", ".join(
            f"{k} {statistics.median(r[k] for r in rows):.2f}"
            if "CPU" in k
            else f"{k} {statistics.median(r[k] for r in rows):.0f}"
            for k in rows[0]
        )
        print(f"{name} {state} {jobs} job(s): {cells}")


if __name__ == "__main__":
    main()
