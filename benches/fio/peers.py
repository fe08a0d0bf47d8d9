#!/usr/bin/env python3
"""Cold reads of the same S3 data through peers that install from this
machine's package registries (s3fs-fuse and rclone, both Debian packages),
with the S3 endpoint behind the same delaying proxy as read_path.py's
"far" part. Reads the datasets read_path.py laid out in --work and its
results.json (local disk and lakecache cold at RTT from the same work
directory), and counts S3 bytes at the endpoint itself
(`/_lakecache/stats`), so every tool's fetch amplification is measured
the same way. Writes benches/results/peers.md.

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

import provenance
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
    if tool == "s3fs":
        passwd = work / "s3fs-passwd"
        passwd.write_text(f"{ACCESS}:{SECRET}\n")
        passwd.chmod(0o600)
        args = ["s3fs", BUCKET, str(s.mnt), "-f", "-o",
                f"url={s.s3_url},use_path_request_style,passwd_file={passwd},"
                "endpoint=us-east-1,listobjectsv2,ro"]
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
    side = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]["read"]
    return {"mib_s": side["bw_bytes"] / 2**20, "iops": side["iops"], "bytes": side["io_bytes"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True, help="lakecache (runs the S3 endpoint)")
    ap.add_argument("--proxy", required=True, help="the delay-proxy binary")
    ap.add_argument("--work", default="/var/tmp/lakecache-readpath")
    ap.add_argument("--rtt-ms", type=int, default=10)
    ap.add_argument("--cap", type=int, default=60, help="seconds per peer job at most")
    ap.add_argument("--out", default=str(HERE.parent / "results" / "peers.md"))
    ap.add_argument("--tools", default="s3fs,rclone",
                    help="peers to run now (none: only rewrite the table); the others' "
                    "results come from the last run")
    a = ap.parse_args()
    work = Path(a.work)
    saved = json.loads((work / "results.json").read_text())
    if "far" not in saved:
        raise SystemExit("run read_path.py (its far part) in --work first")
    versions = install()
    done = work / "peers.json"
    out: dict = {}
    if done.exists():
        out = {tuple(k.split("|")): v for k, v in json.loads(done.read_text()).items()}
    for tool in [t for t in a.tools.split(",") if t and t != "none"]:
        s = Setup(a, work, False, a.rtt_ms)
        try:
            for name, job, env, unit in TESTS:
                p = peer_mount(tool, s, work)
                drop_caches()
                before = endpoint_stats(s.s3_port)
                if job == "ls":
                    r = ls_then_read(s.mnt)
                else:
                    r = fio_capped(job, s.mnt, a.cap, {"runtime": "10", **env})
                after = endpoint_stats(s.s3_port)
                sent, gets = after[0] - before[0], after[1] - before[1]
                r["s3_per_byte"] = sent / max(r["bytes"], 1)
                r["gets"] = gets
                unmount(s, p)
                out[(tool, name)] = r
                done.write_text(json.dumps({"|".join(k): v for k, v in out.items()}))
                print(f"[{tool} rtt={a.rtt_ms}] {name}: {r[unit]:.0f} "
                      f"({r['s3_per_byte']:.2f} S3 bytes per byte)", flush=True)
        finally:
            s.close()
    write(a, saved, versions, out)


def num(v: float) -> str:
    return f"{v:.1f}" if v < 100 else f"{v:.0f}"


def write(a, saved, versions, out) -> None:
    far = {tuple(k.split("|")): v for k, v in saved["far"]["results"].items()}
    local = saved["far"]["local"]
    unit = {"mib_s": "MiB/s", "iops": "IOPS"}
    lines = [
        "# Cold reads at 10 ms RTT: lakecache vs s3fs and rclone",
        "",
        *provenance.header(),
        "Run as root after `read_path.py` in the same --work.",
        f"Machine: {os.cpu_count()} cores, `uname -r` {os.uname().release}. The same "
        f"s3-server and data as read-path.md, behind delay-proxy at {a.rtt_ms} ms RTT; "
        "page cache dropped before every run; every tool starts cold (lakecache: empty "
        "worker cache and local tier, TLS and tokens on; peers: default caches off, a "
        "fresh mount per test). Peers: " + "; ".join(versions.values()) + ", mounted "
        "read-only with default settings otherwise (rclone `--vfs-cache-mode off`). "
        f"Peer jobs stop after {a.cap} s; their rate is over what they read by then. "
        "lakecache and local-disk columns are from read_path.py's far part "
        f"({saved['far']['when']}). S3 bytes per byte read are counted by the S3 endpoint "
        "for the peers and by the worker for lakecache.",
        "",
        "| test | unit | local disk | lakecache | s3fs | rclone | lakecache / best peer |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, _, _, u in TESTS:
        lc = far[(name, "cold")][u]
        s3fs, rclone = out[("s3fs", name)][u], out[("rclone", name)][u]
        lines.append(f"| {name} | {unit[u]} | {num(local[name][u])} | {num(lc)} | "
                     f"{num(s3fs)} | {num(rclone)} | {lc / max(s3fs, rclone, 1e-9):.2f} |")
    lines += ["", "## S3 bytes fetched per byte read", "",
              "| test | lakecache | s3fs | rclone |", "|---|---|---|---|"]
    for name, *_ in TESTS:
        lines.append(f"| {name} | {far[(name, 'cold')].get('s3_per_byte', 0):.2f} | "
                     f"{out[('s3fs', name)]['s3_per_byte']:.2f} | "
                     f"{out[('rclone', name)]['s3_per_byte']:.2f} |")
    provenance.write(a.out, lines)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
