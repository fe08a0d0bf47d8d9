#!/usr/bin/env python3
"""Why does a whole object in the node-local tier read sequentially slower
than local disk? Four files, each read whole by one fio job (1 job, then 4
at once) with 256 KiB reads after dropping the page cache, from three
places in interleaved rounds:

  local   files on the same filesystem, written by dd
  tier    the tier's own data files for the objects, read directly
  mount   the objects through the mount (FUSE passthrough)

"tier" against "local" isolates the files' layout on disk (how the tier
wrote them); "mount" against "tier" isolates FUSE passthrough. Beside each:
CPU-seconds per GiB of fio and of the mount (a passthrough read costs the
mount nothing), the extents `filefrag` counts, and with --perf the hottest
symbols machine-wide of one 4-job read. Writes
benches/results/l1-seq-profile.md.

Usage (as root; a release build):
    python3 benches/fio/l1_profile.py --bin target/release/lakecache \
        --proxy target/release/delay-proxy
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import cpu
import provenance
import rounds
from read_path import Setup, fill_tier, whole_objects
from run import HERE, drop_caches


def fio_read(files: list[Path]) -> dict:
    """One fio job per file, reading it whole with 256 KiB reads; MiB/s
    and fio's own CPU per GiB."""
    args = [
        "fio",
        "--output-format=json",
        "--rw=read",
        "--bs=256k",
        "--ioengine=psync",
        "--group_reporting=1",
    ]
    for i, f in enumerate(files):
        args += [f"--name=r{i}", f"--filename={f}"]
    out = subprocess.run(args, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"fio failed:\n{out.stdout}\n{out.stderr}")
    job = json.loads(out.stdout[out.stdout.index("{") :])["jobs"][0]
    moved = job["read"]["io_bytes"]
    return {
        "mib_s": job["read"]["bw_bytes"] / 2**20,
        "bytes": moved,
        "cpu_per_gib": cpu.fio_seconds(job) / (moved / (1 << 30)),
    }


def extents(path: Path) -> int:
    out = subprocess.run(["filefrag", str(path)], capture_output=True, text=True, check=True)
    m = re.search(r"(\d+) extents? found", out.stdout)
    if not m:
        raise SystemExit(f"filefrag said {out.stdout!r}")
    return int(m.group(1))


def tier_files(tier: Path) -> dict[str, Path]:
    """The tier's data file of each object, by key."""
    out = {}
    for meta in tier.glob("*.meta"):
        uri = json.loads(meta.read_text())["meta"]["uri"]
        out[uri.rsplit("/", 1)[1]] = meta.with_suffix(".data")
    return out


def perf_top(name: str, run, out_dir: Path) -> list[str]:
    """Runs `run` under `perf record -a -g`; the 25 hottest symbols."""
    data = out_dir / f"perf-{name}.data"
    rec = subprocess.Popen(
        ["perf", "record", "-a", "-g", "-o", str(data)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)  # perf attaches before the run starts
    try:
        run()
    finally:
        rec.send_signal(signal.SIGINT)
        rec.wait(timeout=60)
    rep = subprocess.run(
        [
            "perf",
            "report",
            "-i",
            str(data),
            "--no-children",
            "--sort",
            "comm,sym",
            "--stdio",
            "--percent-limit",
            "1",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    rows = [ln for ln in rep.stdout.splitlines() if re.match(r"\s+\d+\.\d+%", ln)]
    return rows[:25]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--proxy", required=True)
    ap.add_argument("--work", default="/var/tmp/lakecache-l1-profile")
    ap.add_argument("--size-mib", type=int, default=512, help="per file, 4 files")
    ap.add_argument(
        "--perf",
        action="store_true",
        help="also profile one 4-job read of each source with perf record -a -g",
    )
    ap.add_argument("--out", default=str(HERE.parent / "results" / "l1-seq-profile.md"))
    rounds.add_args(ap, default=5)
    a = ap.parse_args()
    n = rounds.check(a.rounds)
    work = Path(a.work)
    if work.exists():
        shutil.rmtree(work)
    (work / "local").mkdir(parents=True)
    started = time.time()
    names = [f"seq.{i}" for i in range(4)]
    local = [work / "local" / nm for nm in names]
    for f in local:
        subprocess.run(
            ["dd", "if=/dev/urandom", f"of={f}", "bs=1M", f"count={a.size_mib}", "status=none"],
            check=True,
        )
    s = Setup(a, work, secure=False, rtt_ms=0)
    profiles: dict[str, list[str]] = {}
    try:
        s.start_worker(fresh=True)
        s.start_mount(tier=True, fresh_tier=True)
        for f in local:
            shutil.copyfile(f, s.mnt / f.name)
        fill_tier(s, [s.mnt / nm for nm in names])
        if whole_objects(s.tier) != len(names):
            raise SystemExit("the tier never held the objects whole")
        s.stop_mount()
        s.start_mount(tier=True)
        by_key = tier_files(s.tier)
        tier = [by_key[nm] for nm in names]
        mnt = [s.mnt / nm for nm in names]
        mount_pid = s.mount.pid if s.mount else None

        def case(source: str, files: list[Path], jobs: int):
            def once() -> dict:
                drop_caches()
                before = cpu.process_seconds(mount_pid) if mount_pid else 0.0
                r = fio_read(files[:jobs])
                spent = (cpu.process_seconds(mount_pid) if mount_pid else 0.0) - before
                r["mount_cpu_per_gib"] = spent / (r["bytes"] / (1 << 30))
                return {f"{source} {jobs}": r}

            return once

        got: dict[str, list[dict]] = {}
        for jobs in (1, 4):
            got.update(
                rounds.interleave(
                    n,
                    [
                        (src, case(src, files, jobs))
                        for src, files in (("local", local), ("tier", tier), ("mount", mnt))
                    ],
                    f"l1 seq {jobs} job(s)",
                )
            )
        frag = {"local": sum(extents(f) for f in local), "tier": sum(extents(f) for f in tier)}
        if a.perf:
            for src, files in (("local", local), ("mount", mnt)):
                profiles[src] = perf_top(src, case(src, files, 4), work)
    finally:
        s.close()
    lines = [
        "# Sequential reads of whole L1 objects: local files, the tier's files, the mount",
        "",
        *provenance.header(),
        f"Rounds: {n}, interleaved; {time.time() - started:.0f} s in all.",
        "",
        f"4 objects of {a.size_mib} MiB, each read whole by one fio job with 256 KiB reads "
        "(psync), page cache dropped before each read. `tier` reads the tier's own data files "
        "directly (no FUSE); `mount` reads the objects through the mount, which FUSE "
        "passthrough serves from those same files. CPU-s/GiB: fio's jobs, and the mount "
        "process (a passthrough read costs it nothing). Extents: `filefrag`, summed over "
        "the 4 files.",
        "",
        "| jobs | read from | MiB/s | of local | mount CPU-s/GiB | extents |",
        "|---|---|---|---|---|---|",
    ]
    for jobs in (1, 4):
        for src in ("local", "tier", "mount"):
            samples = got[f"{src} {jobs}"]
            lines.append(
                f"| {jobs} | {src} | {rounds.cell(samples, 'mib_s')} | "
                f"{rounds.ratio_cell(samples, got[f'local {jobs}'], 'mib_s')} | "
                f"{rounds.median(samples, 'mount_cpu_per_gib'):.2f} | "
                f"{frag.get(src, frag['tier'])} |"
            )
    for src, rows in profiles.items():
        lines += [
            "",
            f"## perf record -a -g, 4 jobs from {src}: hottest symbols (self time)",
            "",
            "```",
            *rows,
            "```",
        ]
    text = "\n".join(lines) + "\n"
    Path(a.out).write_text(text)
    print(text)
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
