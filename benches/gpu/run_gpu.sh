#!/usr/bin/env bash
# The trainer's GPU measurements, in one call on a GPU machine (H100/H200):
#   1. a model that needs ZeRO-Offload (3B, 7B with --big 7b): tokens/s, MFU,
#      GPU memory, data-wait fraction, checkpoint stall (1B checkpoints only:
#      a 3B+ optimizer state does not fit this box's 64 GiB disk twice);
#   2. the same config with shards on local disk (no-I/O reference), mount
#      cold (empty worker cache) and warm: tokens/s ratio mount/local;
#   3. a 1B model with and without offload_optimizer: GPU memory, tokens/s.
# Needs: a release `lakecache` binary ($LAKECACHE_BIN), PyTorch with CUDA,
# and DeepSpeed + transformers + the lakecache client wheel (carried in: $WHEELS).
# Writes $OUT/gpu-results.md and the JSONL of every run.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${LAKECACHE_BIN:-target/release/lakecache}
OUT=${OUT:-benches/results/gpu}
WORK=${WORK:-/var/tmp/lakecache-gpu}
DATA_GIB=${DATA_GIB:-4}
BIG=${BIG:-3b}
STEPS=${STEPS:-20}
mkdir -p "$OUT" "$WORK"
# The lakecache Python client (the trainer's loader lives in it): a wheel
# built with `maturin build --release` where Rust is, or built here.
if [ -n "${WHEELS:-}" ]; then
  pip install -q --no-index --find-links "$WHEELS" deepspeed transformers safetensors ninja lakecache
else
  pip install -q ./pyclient
fi
pip install -q --no-deps --no-build-isolation -e trainer
export PATH="$(dirname "$(command -v python)"):$PATH"

mnt=$WORK/mnt
start() { # $1: fresh cache or not
  [ "$1" = fresh ] && rm -rf "$WORK/data/cache"
  "$BIN" up --dir "$WORK/data" --mount "$mnt" --cache-size 40GiB \
    --s3-listen 127.0.0.1:9000 --listen 127.0.0.1:9500 >"$WORK/up.log" 2>&1 &
  UP=$!
  for _ in $(seq 300); do grep -q "^try:" "$WORK/up.log" && return; sleep 0.1; done
  echo "lakecache up did not start:"; cat "$WORK/up.log"; exit 1
}
stop() { kill -TERM "$UP"; wait "$UP" || true; }

train() { # name, model, data dir, extra args...
  local name=$1 model=$2 data=$3; shift 3
  python -m lakecache_trainer.cli run --model "$model" --data "$data" \
    --checkpoint-dir "$mnt/checkpoints/$name" --metrics "$OUT/$name.jsonl" \
    --seq-len 2048 --micro-batch 1 --steps "$STEPS" --warmup 2 --no-resume "$@" \
    | tail -n 1 | tee "$OUT/$name.summary.json"
}

start fresh
python -m lakecache_trainer.cli prepare --out "$mnt/datasets/gpu" \
  --synthetic "${DATA_GIB}GiB" --shard-tokens $((96 << 20))
mkdir -p "$WORK/local" && cp "$mnt"/datasets/gpu/*.bin "$WORK/local/"
stop

# 1 + 2: the offload model, mount cold, mount warm, local disk.
start fresh; echo 3 > /proc/sys/vm/drop_caches
train "$BIG-mount-cold" "$BIG" "$mnt/datasets/gpu" --save-every 0
train "$BIG-mount-warm" "$BIG" "$mnt/datasets/gpu" --save-every 0
train "$BIG-local" "$BIG" "$WORK/local" --save-every 0
# 3: 1B with and without optimizer offload; checkpoints through the mount.
train 1b-offload 1b "$mnt/datasets/gpu" --save-every 10
train 1b-no-offload 1b "$mnt/datasets/gpu" --save-every 10 --no-offload-optimizer
stop

python - "$OUT" "$BIG" <<'EOF'
import json, sys
out, big = sys.argv[1], sys.argv[2]
def s(name):
    return json.loads(open(f"{out}/{name}.summary.json").read())
rows = [f"{big}-mount-cold", f"{big}-mount-warm", f"{big}-local", "1b-offload", "1b-no-offload"]
lines = ["| run | params | tokens/s | MFU | GPU mem peak GiB | data wait | ckpt stall s |",
         "|---|---|---|---|---|---|---|"]
for r in rows:
    x = s(r)
    mfu = f"{x['mfu']:.3f}" if x["mfu"] is not None else "n/a"
    lines.append(f"| {r} | {x['params']/1e9:.2f}B | {x['tokens_per_s']:.0f} | {mfu} | "
                 f"{x['gpu_mem_peak_gib']:.1f} | {x['data_wait_frac']:.4f} | {x['checkpoint_stall_s']:.1f} |")
local = s(f"{big}-local")["tokens_per_s"]
lines.append("")
for r in (f"{big}-mount-cold", f"{big}-mount-warm"):
    lines.append(f"- {r} / local tokens/s: {s(r)['tokens_per_s'] / local:.3f}")
a, b = s("1b-offload"), s("1b-no-offload")
lines.append(f"- 1B GPU memory with offload_optimizer: {a['gpu_mem_peak_gib']:.1f} GiB vs "
             f"{b['gpu_mem_peak_gib']:.1f} GiB without ({1 - a['gpu_mem_peak_gib']/b['gpu_mem_peak_gib']:.0%} less); "
             f"tokens/s {a['tokens_per_s']:.0f} vs {b['tokens_per_s']:.0f}")
open(f"{out}/gpu-results.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
