#!/usr/bin/env bash
# Nightly-style run of the filesystem core's reference-model test with many
# more cases than the test command (4000). Usage:
#   benches/model/reftest-long.sh [CASES]        (default 100000)
# Appends one line per run to benches/results/reftest.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/deps.sh
cases="${1:-100000}"
started=$(date +%s)
PROPTEST_CASES="$cases" cargo test --release --locked -p lakecache-fuse --test reftest -- --nocapture
took=$(( $(date +%s) - started ))
mkdir -p benches/results
echo "| $(date -u +%Y-%m-%d) | $(git rev-parse --short HEAD) | $cases | passed | ${took} s |" >> benches/results/reftest.md
echo "reftest: $cases cases passed in ${took} s"
