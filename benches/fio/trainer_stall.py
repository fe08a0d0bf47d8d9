#!/usr/bin/env python3
"""The trainer's checkpoint stall (time a save blocks training, from its
own metrics) with the checkpoint directory on local disk vs a lakecache
mount writing `through` vs `back`; one session, CPU (gloo, DeepSpeed CPU
Adam). Writes benches/results/trainer-stall.md.

Usage (as root, release binary built, the trainer's venv from the test
command):
    /var/cache/lakecache/venv/bin/python benches/fio/trainer_stall.py \
        --bin target/release/lakecache
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import provenance
from run import Cluster

HERE = Path(__file__).resolve().parent


def train(data: Path, ckpt: Path, metrics: Path, a: argparse.Namespace) -> dict:
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "2",
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
    }
    cmd = [
        sys.executable,
        "-m",
        "lakecache_trainer.cli",
        "run",
        "--data",
        str(data),
        "--checkpoint-dir",
        str(ckpt),
        "--metrics",
        str(metrics),
        "--model",
        a.model,
        "--seq-len",
        "128",
        "--micro-batch",
        "2",
        "--steps",
        str(a.steps),
        "--save-every",
        str(a.save_every),
        "--warmup",
        "2",
        "--allow-unsigned-checkpoints",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise SystemExit(f"trainer failed:\n{out.stderr[-4000:]}")
    summary = [json.loads(line) for line in metrics.read_text().splitlines()][-1]
    saves = [
        json.loads(line)["checkpoint_stall_s"]
        for line in metrics.read_text().splitlines()
        if '"summary"' not in line and json.loads(line).get("checkpoint_stall_s", 0) > 0
    ]
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    return {"stall_total": summary["checkpoint_stall_s"], "saves": saves, "bytes": size}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--work", default="/var/tmp/lakecache-trainer-stall")
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--out", default=str(HERE.parent / "results" / "trainer-stall.md"))
    a = ap.parse_args()
    work = Path(a.work)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    data = work / "data"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "lakecache_trainer.cli",
            "prepare",
            "--out",
            str(data),
            "--synthetic",
            "8MiB",
            "--shard-tokens",
            "400000",
        ],
        check=True,
        capture_output=True,
    )
    rows = {}
    c = Cluster(a.bin, work)
    try:
        for mode in ("local", "through", "back"):
            if mode == "local":
                ckpt = work / "local-ckpt"
            else:
                c.start_worker(fresh=True, mount_flags=("--write-mode", mode))
                ckpt = c.mnt / "checkpoints" / mode
            rows[mode] = train(data, ckpt, work / f"{mode}.jsonl", a)
            print(mode, rows[mode], flush=True)
            if mode != "local":
                c.stop_worker()
    finally:
        c.close()
    local = rows["local"]
    lines = [
        "# Trainer checkpoint stall: local disk vs lakecache `through` vs `back`",
        "",
        *provenance.header(),
        f"Machine: {os.cpu_count()} cores, no GPU: one process, gloo, DeepSpeed ZeRO-2 with "
        "CPU Adam. s3-server, one worker (plain HTTP, no tokens) and the mount on this "
        "machine. The stall is the trainer's own `checkpoint_stall_s`: "
        "`save_checkpoint` plus its loader/RNG files and `latest`, barrier to barrier.",
        "",
        "| checkpoint dir | saves | bytes per save | stall per save (s) | vs local |",
        "|---|---|---|---|---|",
    ]
    for mode in ("local", "through", "back"):
        r = rows[mode]
        per = r["stall_total"] / max(len(r["saves"]), 1)
        local_per = local["stall_total"] / max(len(local["saves"]), 1)
        lines.append(
            f"| {mode} | {len(r['saves'])} | {r['bytes'] // max(len(r['saves']), 1):,} | "
            f"{per:.2f} | {per / local_per:.2f} |"
        )
    provenance.write(a.out, lines)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
