#!/usr/bin/env bash
# Long run of the widened power-loss sweep (the test command runs 50 cuts):
# S3 on, a second copy, torn and reordered unsynced writes, cuts at every
# cut point of the write path, the upload, the settle and journal
# compaction. Usage:
#   benches/model/power-sweep-long.sh [CUTS] [SEED]   (default 500, random)
# The seed is printed; a failure names its pass and cut, replayed with
#   LAKECACHE_POWER_SEED=<seed> LAKECACHE_POWER_AT=<pass>:<cut> (same test).
# Appends one line per run to benches/results/power-sweep.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/deps.sh
cuts="${1:-500}"
seed="${2:-$(od -An -N8 -tu8 /dev/urandom | tr -d ' ')}"
case "$cuts" in ''|*[!0-9]*|0) echo "CUTS must be a positive whole number, not '$cuts'" >&2; exit 2;; esac
case "$seed" in ''|*[!0-9]*) echo "SEED must be a whole number, not '$seed'" >&2; exit 2;; esac
started=$(date +%s)
log=$(mktemp)
LAKECACHE_POWER_CUTS="$cuts" LAKECACHE_POWER_SEED="$seed" \
  cargo test --locked -p lakecache-worker --test integration -- power_sweep --nocapture 2>&1 \
  | grep -v ' WARN \| INFO ' | tee "$log"
took=$(( $(date +%s) - started ))
sites=$(grep -E '^ +[0-9]+  ' "$log" | awk '{n=$1; $1=""; sub(/^ /,""); printf "%s%s: %s", sep, $0, n; sep="; "}')
mkdir -p benches/results
if [ ! -f benches/results/power-sweep.md ]; then
  printf '# Power-loss sweep, long runs\n\n`benches/model/power-sweep-long.sh`: S3 on, two copies, torn writes.\n\n| date | commit | seed | cuts | result | cuts per site | time |\n|---|---|---|---|---|---|---|\n' > benches/results/power-sweep.md
fi
echo "| $(date -u +%Y-%m-%d) | $(git rev-parse --short HEAD) | $seed | $cuts | passed | $sites | ${took} s |" >> benches/results/power-sweep.md
echo "power sweep: $cuts cuts passed in ${took} s (seed $seed)"
rm -f "$log"
