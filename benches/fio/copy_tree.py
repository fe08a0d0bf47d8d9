#!/usr/bin/env python3
"""`cp -a`, `rsync -a` and `tar x` of a 1,000-file tree (modes, owners,
nanosecond times, symlinks) onto local disk and onto a lakecache mount
(through and back), in one session; checks the copies match the source
and writes benches/results/copy-tree.md.

Usage (as root):
    python3 benches/fio/copy_tree.py --bin target/release/lakecache --work /var/tmp/lc-copy
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import time
from pathlib import Path

import provenance
from run import Cluster, drop_caches

FILES, DIRS = 1000, 20


def make_tree(src: Path) -> None:
    for d in range(DIRS):
        sub = src / f"d{d:02}"
        sub.mkdir(parents=True)
        for f in range(FILES // DIRS):
            p = sub / f"f{f:03}.bin"
            p.write_bytes(os.urandom(4096 + 97 * f))
            os.chmod(p, (0o600, 0o640, 0o644, 0o755)[f % 4])
            os.utime(p, ns=(1_700_000_000_000_000_000 + f, 1_700_000_000_123_456_789 + f))
        os.symlink("f000.bin", sub / "latest")
        os.chown(sub / "f001.bin", 1234, 5678)
        os.utime(sub, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000 + d))


def listing(root: Path) -> list[str]:
    out = subprocess.run(
        ["find", str(root), "-mindepth", "1", "-printf", "%m %U %G %T@ %y %l %s %P\n"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    rows = []
    for line in out.splitlines():
        parts = line.split(" ")
        if parts[4] == "d":
            parts[-2] = "-"  # a directory's size is the file system's business
        rows.append(" ".join(parts))
    return sorted(rows)


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - start


def copies(src: Path, dest: Path, tarball: Path) -> dict[str, float]:
    out = {
        "cp -a": timed(["cp", "-a", str(src), str(dest / "cp")]),
        "rsync -a": timed(["rsync", "-a", f"{src}/", str(dest / "rsync")]),
    }
    (dest / "tar").mkdir()
    out["tar x"] = timed(["tar", "-C", str(dest / "tar"), "-xpf", str(tarball)])
    want = listing(src)
    for name in ("cp", "rsync", "tar"):
        if listing(dest / name) != want:
            raise SystemExit(f"{name} copy in {dest} differs from the source")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--work", default="/var/tmp/lc-copy")
    ap.add_argument(
        "--out", default=str(Path(__file__).resolve().parents[1] / "results" / "copy-tree.md")
    )
    args = ap.parse_args()
    work = Path(args.work)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    src = work / "src"
    make_tree(src)
    tarball = work / "tree.tar"
    subprocess.run(["tar", "--format=posix", "-C", str(src), "-cf", str(tarball), "."], check=True)
    results: dict[str, dict[str, float]] = {}
    local = work / "local"
    local.mkdir()
    drop_caches()
    results["local disk"] = copies(src, local, tarball)
    for mode in ("through", "back"):
        cluster = Cluster(args.bin, work / mode)
        try:
            cluster.start_worker(fresh=True, mount_flags=("--write-mode", mode))
            drop_caches()
            results[f"lakecache ({mode})"] = copies(src, cluster.mnt, tarball)
        finally:
            cluster.close()
    base = results["local disk"]
    lines = [
        "# Copying a 1,000-file tree onto the mount vs local disk",
        "",
        f"{FILES} files of 4-101 KiB in {DIRS} directories, modes 600/640/644/755,",
        "one owner change and one symlink per directory, nanosecond times;",
        "each copy checked equal to the source (`find -printf '%m %U %G %T@ %y %l %s %P'`).",
        "One worker, embedded S3 on loopback, this 2-core machine.",
        "",
        *provenance.header(),
        "",
        "| target | cp -a | rsync -a | tar x | cp -a vs local |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['cp -a']:.2f} s | {r['rsync -a']:.2f} s | {r['tar x']:.2f} s "
            f"| {r['cp -a'] / base['cp -a']:.1f}x |"
        )
    provenance.write(args.out, lines)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
