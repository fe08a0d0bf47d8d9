#!/usr/bin/env python3
"""What TLS and token checks cost: warm sequential reads through the mount
with 4 fio jobs, plain HTTP without tokens vs HTTPS with tokens, in one
session on one machine, alternating the two setups; writes
benches/results/security-overhead.md.

Usage (as root, release binary built):
    python3 benches/fio/security_overhead.py --bin target/release/lakecache
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import provenance
from run import HERE, Cluster, fio


def secure_flags(binary: str, work: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A CA and worker certificate (openssl), signing keys and a token."""
    sec = work / "sec"
    sec.mkdir()

    def sh(*args: str) -> str:
        return subprocess.run(
            args, cwd=sec, check=True, capture_output=True, text=True
        ).stdout

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    sh(
        "openssl",
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=bench-ca",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )
    (sec / "leaf.ext").write_text(
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    sh(
        "openssl",
        "req",
        *ec,
        "-keyout",
        "leaf.key",
        "-out",
        "leaf.csr",
        "-subj",
        "/CN=worker",
    )
    sh(
        "openssl",
        "x509",
        "-req",
        "-in",
        "leaf.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "leaf.pem",
        "-days",
        "2",
        "-extfile",
        "leaf.ext",
    )
    sh(binary, "token", "keygen", "--out", str(sec / "keys"))
    token = sh(
        binary,
        "token",
        "create",
        "--keys",
        str(sec / "keys"),
        "--tenant",
        "bench",
        "--allow-write",
        "s3://bench/",
    )
    (sec / "token").write_text(token)
    worker = (
        "--auth-keys",
        str(sec / "keys"),
        "--tls-cert",
        str(sec / "leaf.pem"),
        "--tls-key",
        str(sec / "leaf.key"),
    )
    mount = ("--tls-ca", str(sec / "ca.pem"), "--token-file", str(sec / "token"))
    return worker, mount


def cpu_seconds(*pids: int) -> float:
    """User + system CPU time of these processes so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / tick


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--work", default="/var/tmp/lakecache-sec")
    ap.add_argument("--size", default="512M", help="per file, 4 files")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--out", default=str(HERE.parent / "results" / "security-overhead.md")
    )
    a = ap.parse_args()
    work = Path(a.work)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    secure_worker, secure_mount = secure_flags(a.bin, work)
    keys_only = (secure_worker[0], secure_worker[1], "--insecure-http")
    token_only = secure_mount[2:]
    setups = {
        "plain HTTP, no tokens": (("--insecure-http", "--no-auth"), ()),
        "plain HTTP + tokens": (keys_only, token_only),
        "HTTPS + tokens": (secure_worker, secure_mount),
    }
    c = Cluster(a.bin, work)
    results: dict[str, list[float]] = {name: [] for name in setups}
    cpu: dict[str, list[float]] = {name: [] for name in setups}
    gib = 4 * int(a.size.rstrip("M")) / 1024
    try:
        c.start_worker(fresh=True)
        fio("seq-read.fio", c.mnt, size=a.size, jobs="4")  # lays the files out
        c.stop_worker()
        for r in range(a.rounds):
            for name, (wf, mf) in setups.items():
                c.start_worker(fresh=True, worker_flags=wf, mount_flags=mf)
                fio(
                    "seq-read.fio", c.mnt, size=a.size, jobs="4"
                )  # fills the worker cache
                pids = (c.worker.pid, c.mount.pid)
                before = cpu_seconds(*pids)
                warm = fio("seq-read.fio", c.mnt, size=a.size, jobs="4")["mib_s"]
                used = (cpu_seconds(*pids) - before) / gib
                c.stop_worker()
                results[name].append(warm)
                cpu[name].append(used)
                print(
                    f"round {r + 1}: {name}: {warm:.0f} MiB/s, {used:.2f} CPU-s/GiB",
                    flush=True,
                )
    finally:
        c.close()
    plain = statistics.median(results["plain HTTP, no tokens"])
    secure = statistics.median(results["HTTPS + tokens"])
    lines = [
        "# TLS and token overhead: warm sequential reads through the mount",
        "",
        *provenance.header(),
        (
            f"Machine: {os.cpu_count()} cores, `uname -r` {os.uname().release}. One s3-server, "
            "one worker and one mount on this machine. fio `seq-read.fio`, 256 KiB reads, "
            f"4 jobs x {a.size}; each round starts a fresh worker, reads once to fill its "
            "cache, then measures the warm read. The setups alternate so drift hits them all."
        ),
        "",
        "| setup | "
        + " | ".join(f"round {i + 1}" for i in range(a.rounds))
        + " | median MiB/s | median CPU-s/GiB |",
        "|---|" + "---|" * (a.rounds + 2),
    ]
    for name, values in results.items():
        cells = " | ".join(f"{v:.0f}" for v in values)
        lines.append(
            f"| {name} | {cells} | {statistics.median(values):.0f} | "
            f"{statistics.median(cpu[name]):.2f} |"
        )
    cpu_plain = statistics.median(cpu["plain HTTP, no tokens"])
    cpu_secure = statistics.median(cpu["HTTPS + tokens"])
    tokens = statistics.median(results["plain HTTP + tokens"])
    lines += [
        "",
        (
            f"HTTPS + tokens / plain = **{secure / plain:.3f}** "
            f"(cost {100 * (1 - secure / plain):.1f}% of warm throughput; the issue's bound "
            f"is 10%). Tokens alone: plain HTTP + tokens / plain = **{tokens / plain:.3f}**."
        ),
        "",
        (
            "CPU time of the worker and mount processes per GiB read (user + system, from "
            "/proc; fio's own CPU not included), median: "
            f"plain {cpu_plain:.2f} s/GiB, HTTPS + tokens {cpu_secure:.2f} s/GiB "
            f"(+{100 * (cpu_secure / cpu_plain - 1):.0f}%). On this 2-core machine fio, the "
            "mount and the worker share both cores, so CPU spent on TLS comes straight out "
            "of throughput; on separate client and cache nodes it would not."
        ),
    ]
    provenance.write(a.out, lines)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
