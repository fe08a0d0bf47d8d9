#!/usr/bin/env python3
"""Issue #33's write targets from one command, in one run, median of N
interleaved rounds:

- write-back, one copy, 1 GiB + fsync through the mount vs local disk
  (and with 3 workers x 2 copies beside it);
- write-through 1 GiB + fsync vs a plain S3 client's upload of the same
  1 GiB to the same endpoint (boto3's `upload_file`, its default
  multipart settings; and one `put_object` beside it);
- the trainer's own checkpoint stall (DeepSpeed save) with the checkpoint
  directory on local disk, on the mount writing `back`, and `through`.

Writes benches/results/checkpoint-writes.md. Usage (as root, release
binary built, the trainer's venv from the test command):
    /var/cache/lakecache/venv/bin/python benches/fio/checkpoint_writes.py \\
        --bin target/release/lakecache
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import cpu
import provenance
import rounds
from run import ACCESS, BUCKET, SECRET, Cluster, drop_caches, remove_work
from trainer_stall import train
from write_path import end_mode, fio_write, sync_seconds

HERE = Path(__file__).resolve().parent
WRITE_MODES = ("local", "back", "back-streamed", "back-r2", "through")
STALL_MODES = ("local", "back", "back-streamed", "through")


def boto3_client(port: int):
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "boto3"], check=True)
        import boto3
        from botocore.config import Config
    return boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{port}",
        aws_access_key_id=ACCESS,
        aws_secret_access_key=SECRET,
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}),
    )


def plain_put(c: Cluster, source: Path) -> dict:
    """MiB/s of boto3's upload_file (multipart, its defaults: 8 MiB parts,
    10 threads) and of one put_object of the file, read from disk after
    the page cache is dropped; this process's CPU per GiB."""
    s3 = boto3_client(c.s3_port)
    size = source.stat().st_size
    out: dict[str, float] = {}
    for name, upload in (
        ("upload_file", lambda: s3.upload_file(str(source), BUCKET, "plain/upload_file.bin")),
        ("put_object", lambda: s3.put_object(
            Bucket=BUCKET, Key="plain/put_object.bin", Body=open(source, "rb"))),
    ):
        drop_caches()
        meter = cpu.Meter()
        start = time.monotonic()
        upload()
        seconds = time.monotonic() - start
        out[name] = size / 2**20 / seconds
        out[f"{name}_cpu_per_gib"] = meter.per_gib(size)
    s3.delete_object(Bucket=BUCKET, Key="plain/upload_file.bin")
    s3.delete_object(Bucket=BUCKET, Key="plain/put_object.bin")
    out["best"] = max(out["upload_file"], out["put_object"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--work", default="/var/tmp/lakecache-ckpt-writes")
    ap.add_argument("--size", default="1G", help="fio file size (one writer)")
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--no-trainer", action="store_true", help="skip the checkpoint stall")
    ap.add_argument("--out", default=str(HERE.parent / "results" / "checkpoint-writes.md"))
    rounds.add_args(ap)
    a = ap.parse_args()
    rounds.check(a.rounds)
    # The trainer from this checkout, whether or not the venv has it installed.
    trainer = str(HERE.parents[1] / "trainer")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (trainer, os.environ.get("PYTHONPATH")) if p
    )
    work = Path(a.work)
    if work.exists():
        shutil.rmtree(work)
    (work / "local").mkdir(parents=True)
    data = work / "data"
    if not a.no_trainer:
        subprocess.run(
            [sys.executable, "-m", "lakecache_trainer.cli", "prepare", "--out", str(data),
             "--synthetic", "8MiB", "--shard-tokens", "400000"],
            check=True, capture_output=True,
        )
    c = Cluster(a.bin, work)

    def once(mode: str) -> dict:
        target = work / "local" if mode == "local" else c.start_write_mode(mode)
        daemons = c.daemons() if mode != "local" else []
        d = target / "fio"
        d.mkdir(parents=True, exist_ok=True)
        drop_caches()
        meter = cpu.Meter(daemons)
        r: dict[str, float] = {}
        r["fio"], written, fio_cpu = fio_write(d, a.size, 1)
        r["fio_cpu_per_gib"] = meter.per_gib(written, fio_cpu)
        result = {f"write-{mode}": r}
        if mode == "through":
            result["plain-put"] = plain_put(c, local_file())
        if mode.startswith("back"):
            sync_seconds(a.bin, c, "")
        if mode in STALL_MODES and not a.no_trainer:
            ckpt = work / "local-ckpt" if mode == "local" else c.mnt / "checkpoints" / mode
            # The trainer appends to its metrics file: one per run.
            metrics = work / f"{mode}.jsonl"
            metrics.unlink(missing_ok=True)
            t = train(data, ckpt, metrics, a)
            saves = max(len(t["saves"]), 1)
            per_save = {"stall": t["stall_total"] / saves, "bytes": t["bytes"] / saves}
            result[f"stall-{mode}"] = per_save
            shutil.rmtree(ckpt)
        end_mode(a.bin, c, work, mode, d)
        return result

    def local_file() -> Path:
        """The 1 GiB the plain client uploads: written once, kept."""
        f = work / "plain-source.bin"
        if not f.exists():
            with open(f, "wb") as out:
                for _ in range(parse_size(a.size) >> 20):
                    out.write(os.urandom(1 << 20))
                os.fsync(out.fileno())
        return f

    started = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        rows = rounds.interleave(
            a.rounds, [(m, lambda m=m: once(m)) for m in WRITE_MODES], "checkpoint-writes"
        )
    finally:
        c.close()
    write(a, rows, started)
    remove_work(work)


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text[-1].upper() in units:
        return int(text[:-1]) * units[text[-1].upper()]
    return int(text)


def write(a: argparse.Namespace, rows: dict, started: str) -> None:
    local = rows["write-local"]
    plain = rows["plain-put"]
    through = rows["write-through"]
    lines = [
        "# Checkpoint writes: mount vs local disk, vs a plain S3 client; the trainer's stall",
        "",
        *provenance.header(),
        f"Started {started}. Machine: {os.cpu_count()} cores, kernel {os.uname().release}; "
        "s3-server, the worker(s) and the mount on this machine, all on the same disk as "
        "`local`; plain HTTP, no tokens. The page cache is dropped before every write. Each "
        f"cell: the median of {a.rounds} interleaved rounds (lowest-highest); a ratio is the "
        "median of the per-round ratios against the baseline measured in the same round. "
        "CPU-s/GiB: the writer (fio's job, or boto3's process) plus the lakecache worker(s) "
        "and mount; the S3 endpoint is not counted.",
        "",
        f"## One writer, {a.size} sequential in 1 MiB blocks, fsync, close",
        "",
        "| where | MiB/s | vs local disk |",
        "|---|---|---|",
    ]
    names = {
        "local": "local disk",
        "back": "mount, write-back, 1 copy (staged file, committed by the local worker)",
        "back-streamed": "mount, write-back, 1 copy, `--staged-writes=false` (streamed)",
        "back-r2": "mount, write-back, 3 workers x 2 copies",
        "through": "mount, write-through (close = in S3)",
    }
    for m in WRITE_MODES:
        k = f"write-{m}"
        lines.append(
            f"| {names[m]} | {rounds.cell(rows[k], 'fio')} | "
            f"{rounds.ratio_cell(rows[k], local, 'fio')} |"
        )
    ratio = rounds.ratio_cell(
        [{"fio": t["fio"]} for t in through], [{"fio": p["best"]} for p in plain], "fio"
    )
    lines += [
        "",
        "## Write-through against what the endpoint takes from a plain S3 client",
        "",
        "| plain client | MiB/s |",
        "|---|---|",
        f"| boto3 upload_file (8 MiB parts, 10 threads) | {rounds.cell(plain, 'upload_file')} |",
        f"| boto3 put_object (one request) | {rounds.cell(plain, 'put_object')} |",
        "",
        f"Write-through / the better plain client, per round: **{ratio}**",
    ]
    if not a.no_trainer:
        lstall = rows["stall-local"]
        lines += [
            "",
            "## The trainer's checkpoint stall (its own `checkpoint_stall_s`, per save)",
            "",
            f"`lakecache_trainer.cli run --model {a.model} --steps {a.steps} "
            f"--save-every {a.save_every}`: one process, gloo, DeepSpeed ZeRO-2 with CPU Adam.",
            "",
            "| checkpoint dir | bytes per save | stall per save (s) | vs local |",
            "|---|---|---|---|",
        ]
        for m in STALL_MODES:
            k = f"stall-{m}"
            lines.append(
                f"| {names[m]} | {int(rows[k][0]['bytes']):,} | {rounds.cell(rows[k], 'stall')} | "
                f"{rounds.ratio_cell(rows[k], lstall, 'stall')} |"
            )
    provenance.write(a.out, lines)
    print("\n".join(lines))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
