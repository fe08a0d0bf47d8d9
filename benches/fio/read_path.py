#!/usr/bin/env python3
"""The read path in three states against local disk, in one run on one
machine: cold (empty worker cache and local tier), L2-warm (worker cache
warm, no local tier, page cache dropped) and L1-warm (local tier whole,
page cache dropped), for sequential, random, small-file and
`ls -l`-then-read jobs; with TLS and tokens on (as users run it), with
them off, and with the S3 endpoint behind a delaying proxy (a remote data
lake). Also: S3 bytes fetched per byte read on cold random jobs, and the
mount's peak RSS against its --memory-limit. Writes
benches/results/read-path.md.

Usage (as root; release binaries built: lakecache and delay-proxy):
    python3 benches/fio/read_path.py --bin target/release/lakecache \
        --proxy target/release/delay-proxy
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import cpu
import provenance
import rounds
from run import ACCESS, BUCKET, HERE, SECRET, drop_caches, fio, free_port, mounted, wait_port
from security_overhead import secure_flags

MEMORY_LIMIT = 1 << 30
LS_FILES, LS_FILE_MIB = 256, 8  # the 2 GiB ls -l-then-read dataset


def worker_metric(port: int, name: str, label: str, tls: bool) -> float:
    """Sum of a Prometheus metric's samples (the worker's /metrics)."""
    scheme = "https" if tls else "http"
    out = subprocess.run(
        ["curl", "-sk", f"{scheme}://127.0.0.1:{port}/metrics"],
        capture_output=True, text=True, check=False,
    ).stdout
    total = 0.0
    for line in out.splitlines():
        if line.startswith(name) and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


class Setup:
    """s3-server (optionally behind the delay proxy), one worker, one mount."""

    def __init__(self, a: argparse.Namespace, work: Path, secure: bool, rtt_ms: int) -> None:
        self.bin, self.work, self.secure = a.bin, work, secure
        self.env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS,
                    "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_REGION": "us-east-1"}
        self.s3_port = free_port()
        self.procs: list[subprocess.Popen] = []
        self.s3 = self.spawn([a.bin, "s3-server", "--root", str(work / "s3"), "--listen",
                              f"127.0.0.1:{self.s3_port}", "--access-key", ACCESS,
                              "--secret-key", SECRET, "--bucket", BUCKET])
        wait_port(self.s3_port)
        s3_port = self.s3_port
        if rtt_ms:
            s3_port = free_port()
            self.spawn([a.proxy, "--listen", f"127.0.0.1:{s3_port}", "--upstream",
                        f"127.0.0.1:{self.s3_port}", "--rtt-ms", str(rtt_ms)])
            wait_port(s3_port)
        self.s3_url = f"http://127.0.0.1:{s3_port}"
        if secure:
            sec = work / "sec"
            if sec.exists():
                shutil.rmtree(sec)
            self.worker_flags, self.mount_flags = secure_flags(a.bin, work)
        else:
            self.worker_flags, self.mount_flags = ("--insecure-http", "--no-auth"), ()
        self.worker_port = free_port()
        self.worker: subprocess.Popen | None = None
        self.mount: subprocess.Popen | None = None
        self.mnt = work / "mnt"
        self.mnt.mkdir(exist_ok=True)
        self.tier = work / "tier"

    def spawn(self, args: list[str], log: Path | None = None) -> subprocess.Popen:
        err = open(log, "a") if log else subprocess.DEVNULL
        p = subprocess.Popen(args, env=self.env, stdout=subprocess.DEVNULL, stderr=err)
        self.procs.append(p)
        return p

    def start_worker(self, fresh: bool) -> None:
        cache = self.work / "cache"
        if fresh and cache.exists():
            shutil.rmtree(cache)
        self.worker = self.spawn(
            [self.bin, "worker", *self.worker_flags, "--listen",
             f"127.0.0.1:{self.worker_port}", "--cache-dir", str(cache), "--cache-size",
             "14GiB", "--s3-endpoint", self.s3_url, "--s3-path-style"],
            log=self.work / "worker.log")
        wait_port(self.worker_port)

    def start_mount(self, tier: bool, fresh_tier: bool = False) -> None:
        if fresh_tier and self.tier.exists():
            shutil.rmtree(self.tier)
        flags = ["--local-cache", str(self.tier), "--local-cache-size", "12GiB"] if tier else []
        # The worker is on this host: its page files are read directly
        # (set LAKECACHE_BENCH_HTTP_READS=1 to measure the HTTP path alone).
        if not os.environ.get("LAKECACHE_BENCH_HTTP_READS"):
            flags += ["--local-worker-socket", str(self.work / "cache" / "local.sock")]
        self.mount = self.spawn(
            [self.bin, "mount", f"s3://{BUCKET}", str(self.mnt), "--worker",
             f"127.0.0.1:{self.worker_port}", "--no-s3-fallback", "--memory-limit",
             str(MEMORY_LIMIT), *self.mount_flags, *flags], log=self.work / "mount.log")
        deadline = time.time() + 30
        while not mounted(self.mnt):
            if time.time() > deadline:
                raise SystemExit("mount did not come up; see mount.log")
            time.sleep(0.05)

    def stop(self, p: subprocess.Popen | None) -> None:
        if p and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=120)

    def stop_mount(self) -> int:
        """Unmounts; returns the mount's peak RSS."""
        rss = peak_rss(self.mount.pid) if self.mount else 0
        self.stop(self.mount)
        self.mount = None
        return rss

    def daemons(self) -> list[int]:
        """The worker and mount, whose CPU counts toward CPU-s/GiB (the
        S3 endpoint and the delay proxy stand for the data lake)."""
        return [p.pid for p in (self.worker, self.mount) if p and p.poll() is None]

    def s3_bytes(self) -> float:
        return worker_metric(self.worker_port, "lakecache_s3_transferred", "get_object",
                             self.secure)

    def close(self) -> None:
        self.stop(self.mount)
        for p in reversed(self.procs):
            self.stop(p)


def ls_then_read(directory: Path) -> dict:
    """`ls -l` of the directory, then every file read whole: MiB/s."""
    d = directory / "ls"
    start = time.monotonic()
    entries = sorted(d.iterdir())
    sizes = [e.stat().st_size for e in entries]
    total = 0
    for e in entries:
        with open(e, "rb", buffering=0) as f:
            while chunk := f.read(1 << 20):
                total += len(chunk)
    assert total == sum(sizes), f"read {total} of {sum(sizes)} bytes"
    return {"mib_s": total / 2**20 / (time.monotonic() - start), "bytes": total}


def run_test(test: tuple, directory: Path) -> dict:
    _, job, env, _, _ = test
    if job == "ls":
        return ls_then_read(directory)
    return fio(job, directory, **env)


def layout(directory: Path, size: str) -> None:
    (directory / "small").mkdir(exist_ok=True)
    (directory / "ls").mkdir(exist_ok=True)
    fio("seq-read.fio", directory, size=size, jobs="4")
    fio("rand-read-big.fio", directory, runtime="1")
    fio("small-files.fio", directory)
    block = os.urandom(1 << 20)
    for i in range(LS_FILES):
        with open(directory / "ls" / f"part-{i:04}.bin", "wb") as f:
            for _ in range(LS_FILE_MIB):
                f.write(block)


def fill_tier(setup: Setup, files: list[Path]) -> None:
    """Reads the files through a tier mount until the tier holds them."""
    for _ in range(4):
        drop_caches()  # or the kernel serves the pass and the mount sees nothing
        for p in files:
            with open(p, "rb", buffering=0) as f:
                while f.read(8 << 20):
                    pass
        time.sleep(2)
        if whole_objects(setup.tier) >= len(files):
            return
    print(f"warning: the tier holds {whole_objects(setup.tier)} of {len(files)} objects "
          "whole", flush=True)


def whole_objects(tier: Path) -> int:
    """Objects whose every block is recorded in the tier."""
    whole = 0
    for meta in tier.glob("*.meta"):
        try:
            crcs = json.loads(meta.read_text())["meta"]["crcs"]
        except (OSError, ValueError, KeyError):
            continue
        whole += all(c is not None for c in crcs)
    return whole


def bench(a: argparse.Namespace, work: Path, part: str, tests: list) -> tuple[dict, int]:
    """Runs `tests` in the part's states, interleaved with local disk in
    each round; returns {(test, state): [result per round]} and the peak RSS."""
    secure, rtt, states = PLANS[part]
    if part == "far":
        rtt = a.rtt_ms
    s = Setup(a, work, secure, rtt)
    out: dict = {}
    rss = 0

    def local_once(t: tuple) -> dict:
        drop_caches()
        return {"local": cpu.measured(lambda: run_test(t, work / "local"))}

    def lakecache_once(t: tuple) -> dict:
        nonlocal rss
        got: dict = {}
        s.start_worker(fresh=True)
        s.start_mount(tier=True, fresh_tier=True)
        drop_caches()
        before = s.s3_bytes()
        r = cpu.measured(lambda: run_test(t, s.mnt), s.daemons())
        r["s3_per_byte"] = (s.s3_bytes() - before) / max(r.get("bytes", 0), 1)
        got["cold"] = r
        rss = max(rss, s.stop_mount())
        if "L2" in states:
            s.start_mount(tier=False)
            drop_caches()
            got["L2"] = cpu.measured(lambda: run_test(t, s.mnt), s.daemons())
            rss = max(rss, s.stop_mount())
        if "L1" in states:
            s.start_mount(tier=True)
            fill_tier(s, [p for g in t[4] for p in sorted(s.mnt.glob(g))])
            s.stop_mount()
            s.start_mount(tier=True)
            drop_caches()
            got["L1"] = cpu.measured(lambda: run_test(t, s.mnt), s.daemons())
            rss = max(rss, s.stop_mount())
        s.stop(s.worker)
        return got

    try:
        for t in tests:
            got = rounds.interleave(
                a.rounds,
                [
                    ("local", lambda t=t: local_once(t)),
                    ("lakecache", lambda t=t: lakecache_once(t)),
                ],
                f"{part} {t[0]}",
            )
            for state, samples in got.items():
                out[(t[0], state)] = samples
    finally:
        s.close()
    return out, rss


# part: (TLS and tokens, RTT to S3 in ms (far: --rtt-ms), lakecache states after cold)
PLANS = {"tls": (True, 0, ("L2", "L1")), "plain": (False, 0, ("L2",)), "far": (True, 0, ())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--proxy", required=True, help="the delay-proxy binary")
    ap.add_argument("--work", default="/var/tmp/lakecache-readpath")
    ap.add_argument("--size", default="512M", help="per sequential file, 4 files")
    ap.add_argument("--runtime", default="10", help="seconds per random job")
    ap.add_argument("--rtt-ms", type=int, default=10)
    ap.add_argument("--out", default=str(HERE.parent / "results" / "read-path.md"))
    ap.add_argument("--parts", default="tls,plain,far",
                    help="which runs: tls (cold, L2, L1), plain (cold, L2), far (cold at RTT); "
                    "results of parts not run now come from the last run in --work")
    ap.add_argument("--reuse", action="store_true",
                    help="keep the datasets a previous run laid out in --work")
    ap.add_argument("--only", default="",
                    help="run only tests whose name contains this; the others keep their "
                    "results from the last run in --work")
    rounds.add_args(ap)
    a = ap.parse_args()
    rounds.check(a.rounds)
    work = Path(a.work)
    reuse = a.reuse and (work / "laid-out").exists()
    if work.exists() and not reuse:
        shutil.rmtree(work)
    (work / "local").mkdir(parents=True, exist_ok=True)
    sz, rt = a.size, a.runtime
    tests = [
        ("seq read 256 KiB, 1 job", "seq-read.fio", {"size": sz, "jobs": "1"}, "mib_s",
         ["seq.0"]),
        ("seq read 256 KiB, 4 jobs", "seq-read.fio", {"size": sz, "jobs": "4"}, "mib_s",
         [f"seq.{i}" for i in range(4)]),
        ("rand read 4 KiB, 1 job (2 GiB file)", "rand-read-big.fio", {"runtime": rt}, "iops",
         ["big.bin"]),
        ("rand read 4 KiB, 4 jobs", "rand-read.fio",
         {"size": sz, "jobs": "4", "runtime": rt}, "iops", [f"seq.{i}" for i in range(4)]),
        ("10,000 x 100 KiB files, read once", "small-files.fio", {}, "mib_s", ["small/*"]),
        ("ls -l then read, 256 x 8 MiB", "ls", {}, "mib_s", ["ls/*"]),
    ]
    started = time.time()
    # The datasets: on local disk, and in S3 through a plain mount.
    if not reuse:
        layout(work / "local", sz)
        s = Setup(a, work, False, 0)
        try:
            s.start_worker(fresh=True)
            s.start_mount(tier=False)
            layout(s.mnt, sz)
        finally:
            s.close()
        (work / "laid-out").write_text(f"{sz}\n")
    chosen = [t for t in tests if a.only in t[0]]
    saved = work / "results.json"
    runs = json.loads(saved.read_text()) if saved.exists() else {}
    for part in a.parts.split(","):
        if part not in PLANS:
            raise SystemExit(f"--parts: unknown part {part!r} (tls, plain, far)")
        out, rss = bench(a, work, part, chosen)
        old = runs.get(part, {}) if a.only else {}
        runs[part] = {
            "results": {**old.get("results", {}),
                        **{f"{n}|{st}": r for (n, st), r in out.items()}},
            "rss": max(rss, old.get("rss", 0)),
            "rounds": a.rounds,
            "when": time.strftime("%Y-%m-%d %H:%M"),
        }
        saved.write_text(json.dumps(runs))
    write(a, tests, runs, time.time() - started)


def write(a, tests, runs, elapsed) -> None:
    def results(part: str) -> dict:
        raw = runs.get(part, {}).get("results")
        if not raw or not isinstance(next(iter(raw.values())), list):
            raise SystemExit(f"no {part} part recorded with rounds in --work; run --parts {part}")
        return {tuple(k.split("|")): v for k, v in raw.items()}

    tls, plain, far = results("tls"), results("plain"), results("far")
    cell, ratio = rounds.cell, rounds.ratio_cell
    unit = {"mib_s": "MiB/s", "iops": "IOPS"}
    parts = ", ".join(
        f"{p} {runs[p]['when']} ({runs[p]['rounds']} rounds)" for p in ("tls", "plain", "far")
    )
    lines = [
        "# Read path: local disk vs lakecache cold, L2-warm and L1-warm",
        "",
        *provenance.header(),
        f"Parts and when they ran: {parts} ({elapsed / 60:.0f} min for the last invocation).",
        f"Machine: {os.cpu_count()} cores, `uname -r` {os.uname().release}; s3-server, "
        "worker, mount and fio on this one machine. Page cache dropped before every run. "
        "cold = empty worker cache and empty local tier (the tier on, filling, as `up` "
        "runs it); L2-warm = worker cache warm, mount without a tier; L1-warm = a new "
        "mount over a whole tier (passthrough). TLS = HTTPS between mount and worker with "
        "tokens checked on every request. Each cell: the median of the part's interleaved "
        "rounds (lowest-highest), local disk measured in every round; a ratio is the median "
        "of the per-round ratios to the local disk of the same round. CPU-s/GiB: CPU time "
        "(user + system) of fio's jobs (or the Python reader of `ls -l then read`) and of the "
        "lakecache worker and mount per GiB read, median over the rounds.",
        "",
        "## TLS and tokens on, loopback S3",
        "",
        "| test | unit | local disk | cold | L2-warm | L1-warm | cold/local | L2/local "
        "| L1/local |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, _, _, u, _ in tests:
        lo = tls[(name, "local")]
        c, l2, l1 = tls[(name, "cold")], tls[(name, "L2")], tls[(name, "L1")]
        lines.append(f"| {name} | {unit[u]} | {cell(lo, u)} | {cell(c, u)} | {cell(l2, u)} | "
                     f"{cell(l1, u)} | {ratio(c, lo, u)} | {ratio(l2, lo, u)} | "
                     f"{ratio(l1, lo, u)} |")
    lines += [
        "",
        f"## S3 {a.rtt_ms} ms away (delay-proxy), TLS and tokens on: cold",
        "",
        f"| test | unit | local disk | cold, S3 at {a.rtt_ms} ms RTT | far/local |",
        "|---|---|---|---|---|",
    ]
    for name, _, _, u, _ in tests:
        lo, f = far[(name, "local")], far[(name, "cold")]
        lines.append(f"| {name} | {unit[u]} | {cell(lo, u)} | {cell(f, u)} | {ratio(f, lo, u)} |")
    lines += [
        "",
        "## What TLS and tokens cost (loopback S3)",
        "",
        "| test | unit | cold plain | cold TLS | L2-warm plain | L2-warm TLS |",
        "|---|---|---|---|---|---|",
    ]
    for name, _, _, u, _ in tests:
        cp, ct = plain[(name, "cold")], tls[(name, "cold")]
        wp, wt = plain[(name, "L2")], tls[(name, "L2")]
        lines.append(f"| {name} | {unit[u]} | {cell(cp, u)} | {cell(ct, u)} | {cell(wp, u)} | "
                     f"{cell(wt, u)} |")
    lines += ["", "## S3 bytes fetched per byte read, cold", "",
              "| test | loopback | at RTT |", "|---|---|---|"]
    for name, _, _, _, _ in tests:
        lines.append(f"| {name} | {cell(tls[(name, 'cold')], 's3_per_byte')} | "
                     f"{cell(far[(name, 'cold')], 's3_per_byte')} |")
    peak = max(runs[p]["rss"] for p in ("tls", "plain", "far"))
    lines += ["", f"Mount peak RSS (VmHWM) over every run: {peak / 2**20:.0f} MiB, "
              f"--memory-limit {MEMORY_LIMIT >> 20} MiB."]
    provenance.write(a.out, lines)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
