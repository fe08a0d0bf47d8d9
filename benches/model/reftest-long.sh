#!/usr/bin/env bash
# Nightly-style run of the filesystem core's reference-model test with many
# more cases than the test command (4000). Usage:
#   benches/model/reftest-long.sh [CASES] [SEED]   (default 100000, random)
# The seed is printed; a divergence prints the shortest failing sequence
# proptest finds, and LAKECACHE_MODEL_SEED=<seed> replays the run.
# Appends one line per run to benches/results/reftest.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/deps.sh
cases="${1:-100000}"
seed="${2:-$(od -An -N8 -tu8 /dev/urandom | tr -d ' ')}"
case "$cases" in ''|*[!0-9]*|0) echo "CASES must be a positive whole number, not '$cases'" >&2; exit 2;; esac
case "$seed" in ''|*[!0-9]*) echo "SEED must be a whole number, not '$seed'" >&2; exit 2;; esac
started=$(date +%s)
LAKECACHE_MODEL_SEED="$seed" PROPTEST_CASES="$cases" cargo test --release --locked -p lakecache-fuse --test reftest -- --nocapture
took=$(( $(date +%s) - started ))
mkdir -p benches/results
echo "| $(date -u +%Y-%m-%d) | $(git rev-parse --short HEAD) | $cases (seed $seed) | passed | ${took} s |" >> benches/results/reftest.md
echo "reftest: $cases cases passed in ${took} s (seed $seed)"
