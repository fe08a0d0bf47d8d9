#!/usr/bin/env python3
"""Cold reads of the same S3 data through peers that install from this
machine's package registries (s3fs-fuse and rclone, both Debian packages),
with the S3 endpoint behind the same delaying proxy as read_path.py's
"far" part. Reads the datasets read_path.py laid out in --work; local disk,
lakecache (cold, TLS and tokens on) and each peer are measured in every
round. Counts S3 bytes at the endpoint itself (`/_lakecache/stats`) for
the peers, so every tool's fetch amplification is measured the same way.
Writes benches/results/peers.md.

Usage (as root, after read_path.py; installs s3fs and rclone with apt):
    python3 benches/fio/peers.py --bin target/release/lakecache \
        --proxy target/release/delay-proxy
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import cpu
import provenance
import rounds
from read_path import Setup, ls_then_read
from run import ACCESS, BUCKET, HERE, SECRET, drop_caches, mounted

# (name, fio job or "ls", fio env, unit)
TESTS = [
    ("seq read 256 KiB, 1 job", "seq-read.fio", {"jobs": "1"}, "mib_s"),
    ("seq read 256 KiB, 4 jobs", "seq-read.fio", {"jobs": "4"}, "mib_s"),
    ("rand read 4 KiB, 1 job (2 GiB file)", "rand-read-big.fio", {}, "iops"),
    ("10,000 x 100 KiB files, read once", "small-files.fio", {}, "mib_s"),
    ("ls -l then read, 256 x 8 MiB", "ls", {}, "mib_s"),
]


def install() -> dict[str, str]:
    missing = [p for p, b in (("s3fs", "s3fs"), ("rclone", "rclone")) if not shutil.which(b)]
    if missing:
        subprocess.run(["apt-get", "install", "-y", "-q", *missing], check=True,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    versions = {}
    for tool, args in (("s3fs", ["s3fs", "--version"]), ("rclone", ["rclone", "version"])):
        out = subprocess.run(args, capture_output=True, text=True, check=False)
        versions[tool] = (out.stdout or out.stderr).splitlines()[0].strip()
    return versions


def endpoint_stats(port: int) -> tuple[float, float]:
    """(body bytes sent, GET requests) as the S3 endpoint counted them."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/_lakecache/stats") as r:
        text = r.read().decode()
    sent = gets = 0.0
    for line in text.splitlines():
        if line.startswith("lakecache_s3_endpoint_sent_bytes_total "):
            sent = float(line.rsplit(" ", 1)[1])
        if line.startswith('lakecache_s3_endpoint_requests_total{op="GetObject"}'):
            gets = float(line.rsplit(" ", 1)[1])
    return sent, gets


def peer_mount(tool: str, s: Setup, work: Path) -> subprocess.Popen:
    """The peer mounted at s.mnt, reading s.s3_url, caches off (cold)."""
    if tool.startswith("s3fs"):
        passwd = work / "s3fs-passwd"
        passwd.write_text(f"{ACCESS}:{SECRET}\n")
        passwd.chmod(0o600)
        opts = (f"url={s.s3_url},use_path_request_style,passwd_file={passwd},"
                "endpoint=us-east-1,listobjectsv2,ro")
        if tool == "s3fs-cache":
            # Its whole-file cache on local disk, empty at the start.
            cache = work / "s3fs-cache"
            shutil.rmtree(cache, ignore_errors=True)
            cache.mkdir()
            opts += f",use_cache={cache}"
        args = ["s3fs", BUCKET, str(s.mnt), "-f", "-o", opts]
    else:
        remote = (f":s3,provider=Other,endpoint='{s.s3_url}',access_key_id={ACCESS},"
                  f"secret_access_key={SECRET},region=us-east-1,force_path_style=true,list_version=2:{BUCKET}")
        args = ["rclone", "mount", remote, str(s.mnt), "--read-only", "--vfs-cache-mode",
                "off"]
        # rclone refuses to start when a CA bundle is named in the
        # environment but its transport is not the SDK's own.
        s.env.pop("AWS_CA_BUNDLE", None)
    p = s.spawn(args, log=work / f"{tool}.log")
    deadline = time.time() + 30
    while not mounted(s.mnt):
        if time.time() > deadline or p.poll() is not None:
            raise SystemExit(f"{tool} did not mount; see {work / f'{tool}.log'}")
        time.sleep(0.1)
    return p


def unmount(s: Setup, p: subprocess.Popen) -> None:
    subprocess.run(["fusermount3", "-u", str(s.mnt)], check=False)
    try:
        p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def fio_capped(job: str, directory: Path, cap: int, env: dict) -> dict:
    """fio with a time cap (a peer reading 1 GB of small files at 10 ms
    RTT could take many minutes); the rate is over what it read."""
    e = {**os.environ, "LAKECACHE_FIO_DIR": str(directory), "LAKECACHE_FIO_SIZE": "512M",
         "LAKECACHE_FIO_RUNTIME": str(cap)}
    e.update({f"LAKECACHE_FIO_{k.upper()}": v for k, v in env.items()})
    out = subprocess.run(["fio", "--output-format=json", f"--runtime={cap}",
                          str(HERE / job)], env=e, capture_output=True, text=True,
                         check=False)
    if out.returncode != 0:
        raise SystemExit(f"fio {job} in {directory} failed:\n{out.stdout}\n{out.stderr}")
    job0 = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]
    side = job0["read"]
    return {"mib_s": side["bw_bytes"] / 2**20, "iops": side["iops"], "bytes": side["io_bytes"],
            "fio_cpu_s": cpu.fio_seconds(job0)}


def by_process(run, parts: dict[str, int]) -> dict:
    """Runs one measurement; adds `cpu_parts`: CPU-s per GiB of each named
    process (and of the reader, fio or this script), so that the tool's
    daemons, the S3 endpoint and the proxy can be told apart."""
    before = {name: cpu.process_seconds(pid) for name, pid in parts.items()}
    own = cpu._own_seconds()
    result = run()
    gib = max(result.get("bytes", 0), 1) / 2**30
    used = {name: (cpu.process_seconds(pid) - before[name]) / gib for name, pid in parts.items()}
    used["reader"] = (result.get("fio_cpu_s", 0.0) + cpu._own_seconds() - own) / gib
    result["cpu_parts"] = used
    return result


def endpoint_pids(s: Setup) -> dict[str, int]:
    """The S3 endpoint and the delay proxy in front of it."""
    out = {"endpoint": s.s3.pid}
    for p in s.procs:
        if p.poll() is None and any("delay-proxy" in str(a) for a in p.args):
            out["proxy"] = p.pid
    return out


def measure(job: str, env: dict, directory: Path, cap: int) -> dict:
    if job == "ls":
        return ls_then_read(directory)
    return fio_capped(job, directory, cap, {"runtime": "10", **env})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True, help="lakecache (runs the S3 endpoint)")
    ap.add_argument("--proxy", required=True, help="the delay-proxy binary")
    ap.add_argument("--work", default="/var/tmp/lakecache-readpath")
    ap.add_argument("--rtt-ms", type=int, default=10)
    ap.add_argument("--cap", type=int, default=60, help="seconds per job at most")
    ap.add_argument("--out", default=str(HERE.parent / "results" / "peers.md"))
    ap.add_argument("--only", default="", help="run only tests whose name contains this")
    ap.add_argument("--lake-in-ram", action="store_true",
                    help="after each drop of the page cache, read the endpoint's stored objects "
                    "back into it, so the emulated data lake serves from memory instead of "
                    "from the disk the caches write to (local disk runs stay cold)")
    rounds.add_args(ap)
    a = ap.parse_args()
    rounds.check(a.rounds)
    work = Path(a.work)
    if not (work / "laid-out").exists():
        raise SystemExit(f"lay the datasets out first: read_path.py --work {work}")
    versions = install()
    tests = [t for t in TESTS if a.only in t[0]]
    # TLS and tokens on for lakecache, as users run it; the peers read the
    # same endpoint through the same proxy.
    s = Setup(a, work, True, a.rtt_ms)
    out: dict = {}

    def drop_for_tool() -> None:
        drop_caches()
        if a.lake_in_ram:
            warm_lake(work)

    def local_once(job: str, env: dict) -> dict:
        drop_caches()
        return {"local": cpu.measured(lambda: measure(job, env, work / "local", a.cap))}

    def lakecache_once(job: str, env: dict) -> dict:
        s.start_worker(fresh=True)
        s.start_mount(tier=True, fresh_tier=True)
        drop_for_tool()
        before = s.s3_bytes()
        parts = {"mount": s.mount.pid, "worker": s.worker.pid, **endpoint_pids(s)}
        r = cpu.measured(lambda: by_process(lambda: measure(job, env, s.mnt, a.cap), parts),
                         s.daemons())
        r["s3_per_byte"] = (s.s3_bytes() - before) / max(r["bytes"], 1)
        s.stop_mount()
        s.stop(s.worker)
        return {"lakecache": r}

    def peer_once(tool: str, job: str, env: dict) -> dict:
        p = peer_mount(tool, s, work)
        drop_for_tool()
        before = endpoint_stats(s.s3_port)
        parts = {tool: p.pid, **endpoint_pids(s)}
        r = cpu.measured(lambda: by_process(lambda: measure(job, env, s.mnt, a.cap), parts),
                         [p.pid])
        after = endpoint_stats(s.s3_port)
        r["s3_per_byte"] = (after[0] - before[0]) / max(r["bytes"], 1)
        r["gets"] = after[1] - before[1]
        unmount(s, p)
        return {tool: r}

    try:
        for name, job, env, _ in tests:
            cases = [
                ("local", lambda job=job, env=env: local_once(job, env)),
                ("lakecache", lambda job=job, env=env: lakecache_once(job, env)),
                *[(t, lambda t=t, job=job, env=env: peer_once(t, job, env)) for t in PEERS],
            ]
            for column, samples in rounds.interleave(a.rounds, cases, name).items():
                out[(column, name)] = samples
    finally:
        s.close()
    write(a, tests, versions, out)


PEERS = ("s3fs", "s3fs-cache", "rclone")


def warm_lake(work: Path) -> None:
    """Reads every object the endpoint stores into the page cache: a remote
    data lake never reads from this machine's disk, which the caches under
    test write to."""
    for blob in sorted((work / "s3" / "blobs").glob("*/*")):
        with open(blob, "rb") as f:
            while f.read(8 << 20):
                pass


def write(a, tests, versions, out) -> None:
    unit = {"mib_s": "MiB/s", "iops": "IOPS"}
    cell = rounds.cell
    where = f"behind delay-proxy at {a.rtt_ms} ms RTT" if a.rtt_ms else "on loopback (no proxy)"
    lines = [
        f"# Cold reads at {a.rtt_ms} ms RTT: lakecache vs s3fs and rclone",
        "",
        *provenance.header(),
        "Run as root after `read_path.py` laid the datasets out in the same --work.",
        f"The same s3-server and data as read-path.md, {where}; page cache dropped before "
        "every run"
        + (
            " (then the endpoint's stored objects read back into it: the emulated lake "
            "serves from memory, never from the disk the caches write to; local disk stays "
            "cold)"
            if a.lake_in_ram
            else ""
        )
        + "; every tool starts cold (lakecache: empty "
        "worker cache and local tier, TLS and tokens on; peers: default caches off, a "
        "fresh mount per run; s3fs-cache: s3fs with `use_cache` on local disk, empty at "
        "the start of each run). Peers: " + "; ".join(versions.values()) + ", mounted "
        "read-only with default settings otherwise (rclone `--vfs-cache-mode off`). "
        f"Every job, local disk included, stops after {a.cap} s; its rate is over what it "
        f"read by then. Each cell: the median of {a.rounds} interleaved rounds "
        "(lowest-highest), every tool and local disk measured in every round; the last "
        "column is the median of the per-round ratios of lakecache to the better peer of "
        "that round. S3 bytes per byte read are counted by the S3 endpoint for the peers "
        "and by the worker for lakecache. CPU-s/GiB: CPU time (user + system) of fio's jobs (or "
        "the Python reader of `ls -l then read`) and of the tool's own processes (lakecache "
        "worker and mount; the s3fs or rclone daemon) per GiB read, median over the rounds; "
        "the S3 endpoint and the delay proxy are left out.",
        "",
        "| test | unit | local disk | lakecache | " + " | ".join(PEERS)
        + " | lakecache / best peer |",
        "|---|---|---|---|" + "---|" * len(PEERS) + "---|",
    ]
    for name, _, _, u in tests:
        lc = out[("lakecache", name)]
        best = [
            {u: max(x[u] for x in per_round)}
            for per_round in zip(*(out[(t, name)] for t in PEERS), strict=True)
        ]
        lines.append(
            f"| {name} | {unit[u]} | {cell(out[('local', name)], u)} | {cell(lc, u)} | "
            + " | ".join(cell(out[(t, name)], u) for t in PEERS)
            + f" | {rounds.ratio_cell(lc, best, u)} |"
        )
    lines += ["", "## S3 bytes fetched per byte read", "",
              "| test | lakecache | " + " | ".join(PEERS) + " |",
              "|---|---|" + "---|" * len(PEERS)]
    for name, *_ in tests:
        lines.append(
            f"| {name} | "
            + " | ".join(cell(out[(t, name)], "s3_per_byte") for t in ("lakecache", *PEERS))
            + " |"
        )
    lines += ["", "## CPU-s per GiB by process (median over the rounds)", "",
              "The reader is fio (or the Python reader); the endpoint and the proxy "
              "stand for the remote data lake and are the same programs for every tool.",
              "", "| test | tool | reader | tool's daemons | endpoint | proxy |",
              "|---|---|---|---|---|---|"]
    for name, *_ in tests:
        for tool in ("lakecache", *PEERS):
            parts = [x["cpu_parts"] for x in out[(tool, name)]]

            def med(key, parts=parts):
                # No proxy runs at 0 ms: shown as absent, never as 0.
                if all(key not in p for p in parts):
                    return "—"
                return f"{rounds.median(parts, key):.2f}"

            daemons = (f"mount {med('mount')} + worker {med('worker')}"
                       if tool == "lakecache" else med(tool))
            lines.append(f"| {name} | {tool} | {med('reader')} | {daemons} | "
                         f"{med('endpoint')} | {med('proxy')} |")
    provenance.write(a.out, lines)
    print(f"wrote {a.out}")

if __name__ == "__main__":
    main()
