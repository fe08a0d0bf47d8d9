#!/usr/bin/env python3
"""Checkpoint writes: local disk vs a lakecache mount writing `through`
(close returns once S3 has the file) vs `back` (close returns once the
file is durable in the cache), in one session on one machine; writes
benches/results/write-path.md.

Usage (as root, release binary built):
    python3 benches/fio/write_path.py --bin target/release/lakecache
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import cpu
import provenance
import rounds
from run import BUCKET, Cluster, drop_caches, remove_work

HERE = Path(__file__).resolve().parent
# back-r2: three workers, --write-replicas 2 (each body durable on two).
MODES = ("local", "through", "back", "back-r2")


def fio_write(directory: Path, size: str, jobs: int) -> tuple[float, int, float]:
    """Aggregate MiB/s, bytes written and fio's own CPU seconds of `jobs`
    concurrent fio processes, each writing its own file sequentially in
    1 MiB blocks with fsync at the end (one per rank, as checkpoint writers
    do). Separate processes, not numjobs: fio
    lays out `filename_format` files before writing, which reopens them
    without O_TRUNC, and the mount refuses that."""
    procs = []
    for j in range(jobs):
        d = directory / f"job{j}"
        d.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "LAKECACHE_FIO_DIR": str(d), "LAKECACHE_FIO_SIZE": size}
        procs.append(
            subprocess.Popen(
                ["fio", "--output-format=json", str(HERE / "seq-write.fio")],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    total, written, fio_cpu = 0.0, 0, 0.0
    for p in procs:
        out, err = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"fio in {directory} failed:\n{out}\n{err}")
        doc = json.loads(out[out.index("{") :])
        total += doc["jobs"][0]["write"]["bw_bytes"] / 2**20
        written += doc["jobs"][0]["write"]["io_bytes"]
        fio_cpu += cpu.fio_seconds(doc["jobs"][0])
    return total, written, fio_cpu


def checkpoint(directory: Path, writers: int, size: int) -> float:
    """DeepSpeed-shaped save: `writers` files written at once (1 MiB
    blocks, fsync, close), then `latest` written to a temp name and
    renamed into place. Returns seconds until the last close returned."""
    directory.mkdir(parents=True, exist_ok=True)
    block = os.urandom(1 << 20)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            with open(directory / f"rank{i}_model_states.pt", "wb") as f:
                for _ in range(size >> 20):
                    f.write(block)
                f.flush()
                os.fsync(f.fileno())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    start = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"checkpoint write failed: {errors[0]}")
    tmp = directory.parent / "latest.tmp"
    tmp.write_text(directory.name)
    os.replace(tmp, directory.parent / "latest")
    return time.monotonic() - start


def sync_seconds(binary: str, c: Cluster, prefix: str) -> float:
    start = time.monotonic()
    where = (
        ["--registry", c.registry] if getattr(c, "ring", None)
        else ["--worker", f"127.0.0.1:{c.worker_port}"]
    )
    subprocess.run(
        [
            binary,
            "sync",
            f"s3://{BUCKET}/{prefix}",
            *where,
            "--timeout",
            "1800",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return time.monotonic() - start


def end_mode(binary: str, c: Cluster, work: Path, mode: str, written: Path) -> None:
    """Frees the disk for the next mode: its files (through the mount, so
    S3 drops them too) and its workers' caches. Written-back deletes reach
    S3 before the caches holding them go, or the next round of this mode
    would find the old objects."""
    shutil.rmtree(written)
    if mode.startswith("back"):
        sync_seconds(binary, c, "")
    if mode != "local":
        c.stop_worker()
        for cache in work.glob("cache*"):
            shutil.rmtree(cache)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--work", default="/var/tmp/lakecache-writes")
    ap.add_argument("--size", default="1G", help="fio file size per job")
    ap.add_argument("--ckpt-writers", type=int, default=8)
    ap.add_argument("--ckpt-size", default="512", help="MiB per checkpoint writer")
    ap.add_argument("--out", default=str(HERE.parent / "results" / "write-path.md"))
    ap.add_argument("--keep-work", action="store_true", help="keep --work after a good run")
    rounds.add_args(ap)
    a = ap.parse_args()
    rounds.check(a.rounds)
    work = Path(a.work)
    if work.exists():
        shutil.rmtree(work)
    (work / "local").mkdir(parents=True)
    ckpt_bytes = int(a.ckpt_size) << 20
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    c = Cluster(a.bin, work)

    def mode_once(mode: str) -> dict:
        target = work / "local" if mode == "local" else c.start_write_mode(mode)
        r: dict[str, float] = {}
        daemons = c.daemons() if mode != "local" else []
        for jobs in (1, 4):
            d = target / f"fio{jobs}"
            d.mkdir(parents=True, exist_ok=True)
            drop_caches()
            # CPU until the bytes are where the mode puts them: for back
            # modes that includes the upload `sync` waits for.
            meter = cpu.Meter(daemons)
            r[f"fio{jobs}"], written, fio_cpu = fio_write(d, a.size, jobs)
            if mode.startswith("back"):
                # Each fio run starts from an empty backlog.
                sync_seconds(a.bin, c, "")
            r[f"fio{jobs}_cpu_per_gib"] = meter.per_gib(written, fio_cpu)
        drop_caches()
        meter = cpu.Meter(daemons)
        r["ckpt"] = checkpoint(target / "ckpt" / "step100", a.ckpt_writers, ckpt_bytes)
        if mode == "local":
            subprocess.run(["sync"], check=True)
        else:
            r["ckpt_s3"] = r["ckpt"] + sync_seconds(a.bin, c, f"{mode}/ckpt/")
        r["ckpt_cpu_per_gib"] = meter.per_gib(a.ckpt_writers * ckpt_bytes)
        end_mode(a.bin, c, work, mode, target)
        return {mode: r}

    try:
        rows = rounds.interleave(
            a.rounds, [(m, lambda m=m: mode_once(m)) for m in MODES], "writes"
        )
    finally:
        c.close()
    write(a, rows, started, ckpt_bytes)
    if not a.keep_work:
        remove_work(work)


def write(a: argparse.Namespace, rows: dict, started: str, ckpt_bytes: int) -> None:
    local = rows["local"]
    total = a.ckpt_writers * ckpt_bytes / 2**20
    lines = [
        "# Writes: local disk vs lakecache `through` vs `back`",
        "",
        *provenance.header(),
        f"Machine: {os.cpu_count()} cores, kernel {os.uname().release}; s3-server, one worker "
        "(back-r2: three workers, `--write-replicas 2`; plain HTTP, no tokens) and the mount on "
        "this machine, all on the same disk as `local`. The page cache is dropped before every "
        "run. Each cell: the median of "
        f"{a.rounds} interleaved rounds (lowest-highest); a ratio is the median of the "
        "per-round ratios to local disk measured in the same round. CPU-s/GiB: CPU time "
        "(user + system) of the writers (fio's jobs, or this script's threads for the "
        "checkpoint) and the lakecache worker(s) and mount per GiB written, until the bytes are "
        "in S3 for `back` modes; median over the rounds. The kernel's own writeback "
        "threads are not counted for any column.",
        "",
        "## fio: sequential write, 1 MiB blocks, fsync at the end; one file per writer "
        "(separate fio processes, bandwidth summed)",
        "",
        "| writers | local disk MiB/s | through MiB/s | back MiB/s "
        "| back, 3 workers x 2 copies MiB/s | through/local | back/local | back-r2/local |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for jobs in (1, 4):
        k = f"fio{jobs}"
        cells = [rounds.cell(rows[m], k) for m in MODES]
        ratios = [rounds.ratio_cell(rows[m], local, k) for m in MODES[1:]]
        lines.append(f"| {jobs} x {a.size} | " + " | ".join(cells + ratios) + " |")
    lines += [
        "",
        f"## Checkpoint: {a.ckpt_writers} writers x {a.ckpt_size} MiB at once ({total:.0f} MiB), "
        "then `latest` renamed into place",
        "",
        "Durable = every close returned (local: plus `sync`); in S3 = `lakecache sync` returned.",
        "",
        "| mode | durable (s) | in S3 (s) | durable/local |",
        "|---|---|---|---|",
    ]
    for mode in MODES:
        s3 = "-" if mode == "local" else rounds.cell(rows[mode], "ckpt_s3")
        lines.append(
            f"| {mode} | {rounds.cell(rows[mode], 'ckpt')} | {s3} | "
            f"{rounds.ratio_cell(rows[mode], local, 'ckpt')} |"
        )
    provenance.write(a.out, lines)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
