"""`lakecache-train {prepare,run,export}`."""

from __future__ import annotations

import argparse
import json
import sys

from .shards import ShardError


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().rstrip("ib").rstrip("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def _duration(text: str) -> float:
    t = text.strip().lower()
    scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    for suffix in ("ms", "s", "m", "h"):
        if t.endswith(suffix):
            value = float(t[: -len(suffix)])
            break
    else:
        value, suffix = float(t), "s"
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value * scale[suffix]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lakecache-train")
    sub = p.add_subparsers(dest="cmd", required=True)

    pr = sub.add_parser("prepare", help="tokenize text files into llm.c token shards")
    pr.add_argument("inputs", nargs="*", help="text files or directories")
    pr.add_argument("--out", required=True, help="e.g. /mnt/data/datasets/NAME")
    pr.add_argument("--shard-tokens", type=int, default=64 << 20)
    pr.add_argument("--synthetic", type=_size, default=0, help="generate this much text")
    pr.add_argument("--seed", type=int, default=0)

    r = sub.add_parser("run", help="train (single process or under torchrun/deepspeed)")
    r.add_argument("--data", required=True, help="directory of .bin shards")
    r.add_argument("--checkpoint-dir", required=True)
    r.add_argument("--model", default="tiny")
    r.add_argument("--seq-len", type=int, default=256)
    r.add_argument("--micro-batch", type=int, default=4)
    r.add_argument("--grad-accum", type=int, default=1)
    r.add_argument("--steps", type=int, default=100)
    r.add_argument("--save-every", type=int, default=50, help="0: never save")
    r.add_argument("--lr", type=float, default=3e-4)
    r.add_argument("--warmup", type=int, default=10)
    r.add_argument("--seed", type=int, default=1234)
    r.add_argument("--zero-stage", type=int, choices=[1, 2, 3], default=2)
    r.add_argument("--no-offload-optimizer", action="store_true")
    r.add_argument("--offload-param", action="store_true", help="ZeRO-3 parameter offload")
    r.add_argument("--metrics", help="per-step JSONL (rank 0)")
    r.add_argument("--no-resume", action="store_true")
    r.add_argument("--peak-tflops", type=float)
    r.add_argument("--crash-after-step", type=int, help=argparse.SUPPRESS)
    r.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    r.add_argument(
        "--checkpoint-key-file",
        help="HMAC key signing checkpoint manifests; keep it off the mount "
        "[env LAKECACHE_CHECKPOINT_KEY_FILE]",
    )
    r.add_argument(
        "--allow-unsigned-checkpoints",
        action="store_true",
        help="load checkpoints without a signed manifest (DeepSpeed unpickles them)",
    )

    r.add_argument(
        "--snapshot",
        help="lakecache snapshot manifest (local file) the data must match; its checksum "
        "is recorded in every checkpoint",
    )
    r.add_argument(
        "--allow-data-change",
        action="store_true",
        help="resume even though the data differs from the checkpoint's",
    )
    r.add_argument(
        "--stuck-timeout",
        type=_duration,
        default=1800.0,
        help="exit (code 75) with stacks and in-flight reads when no step completes for "
        "this long, e.g. 30m, 90s [default: 30m]",
    )
    r.add_argument(
        "--build-timeout",
        type=_duration,
        default=1800.0,
        help="the stuck limit while the model and DeepSpeed engine are built (compute "
        "that grows with the model, not a read), e.g. 1h [default: 30m]",
    )
    r.add_argument(
        "--mount-metrics",
        help="the lakecache mount's --metrics-listen address, for the reads a stuck "
        "step waits on [env LAKECACHE_MOUNT_METRICS]",
    )
    r.add_argument(
        "--checkpoint-sync",
        choices=["cache", "s3"],
        default="cache",
        help="move `latest` once the checkpoint is durable in the cache, or once it is in S3",
    )
    r.add_argument(
        "--keep-checkpoints",
        type=int,
        default=0,
        help="keep the newest K checkpoints, deleting older ones after `latest` moved "
        "[default: 0, keep all]",
    )
    r.add_argument(
        "--reshard-on-resize",
        action="store_true",
        help="resume a checkpoint written by another number of ranks: load the weights, "
        "start the optimizer state afresh, reshard the rest of the epoch",
    )
    r.add_argument("--log-every", type=int, default=1, help="loss and metrics every N steps")
    r.add_argument("--inject-hang", help=argparse.SUPPRESS)

    e = sub.add_parser("export", help="consolidated safetensors from a checkpoint")
    e.add_argument("--checkpoint-dir", required=True)
    e.add_argument("--tag")
    e.add_argument("--out", required=True)
    e.add_argument(
        "--checkpoint-key-file",
        help="HMAC key signing checkpoint manifests; keep it off the mount "
        "[env LAKECACHE_CHECKPOINT_KEY_FILE]",
    )
    e.add_argument(
        "--allow-unsigned-checkpoints",
        action="store_true",
        help="load checkpoints without a signed manifest (DeepSpeed unpickles them)",
    )

    a = p.parse_args(argv)
    try:
        if a.cmd == "prepare":
            from .prepare import prepare

            shards = prepare(a.out, a.inputs, a.shard_tokens, a.synthetic, a.seed)
            print(f"wrote {len(shards)} shards to {a.out}")
        elif a.cmd == "run":
            from .train import RunConfig, run

            summary = run(
                RunConfig(
                    data=a.data,
                    checkpoint_dir=a.checkpoint_dir,
                    model=a.model,
                    seq_len=a.seq_len,
                    micro_batch=a.micro_batch,
                    grad_accum=a.grad_accum,
                    steps=a.steps,
                    save_every=a.save_every,
                    lr=a.lr,
                    warmup=a.warmup,
                    seed=a.seed,
                    zero_stage=a.zero_stage,
                    offload_optimizer=not a.no_offload_optimizer,
                    offload_param=a.offload_param,
                    metrics=a.metrics,
                    resume=not a.no_resume,
                    peak_tflops=a.peak_tflops,
                    crash_after_step=a.crash_after_step,
                    checkpoint_key_file=a.checkpoint_key_file,
                    allow_unsigned_checkpoints=a.allow_unsigned_checkpoints,
                    snapshot=a.snapshot,
                    allow_data_change=a.allow_data_change,
                    stuck_timeout=a.stuck_timeout,
                    build_timeout=a.build_timeout,
                    mount_metrics=a.mount_metrics,
                    checkpoint_sync=a.checkpoint_sync,
                    keep_checkpoints=a.keep_checkpoints,
                    log_every=a.log_every,
                    inject_hang=a.inject_hang,
                    reshard_on_resize=a.reshard_on_resize,
                )
            )
            short = {k: v for k, v in summary.items() if k not in ("losses", "time_breakdown")}
            print(json.dumps(short))
        else:
            from .export import export

            print(
                export(
                    a.checkpoint_dir,
                    a.out,
                    a.tag,
                    a.checkpoint_key_file,
                    a.allow_unsigned_checkpoints,
                )
            )
    except ShardError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
