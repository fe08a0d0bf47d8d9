#!/usr/bin/env bash
# Issue #35's benchmark: two shuffled epochs over a data set twice the
# cache's size, with plans (through cluster clients and through real
# mounts), with LRU, with no cache and from local files;
# 1 and 2 ranks; median of 3 runs. Writes benches/results/plan-epochs.md,
# .json and .png. Extra arguments go to the bench (see --help).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/deps.sh
cargo build --release --locked -q -p lakecache-bench --bin plan-epochs
# The `mounts` reader runs the lakecache binary beside the bench.
cargo build --release --locked -q -p lakecache --bin lakecache
"${CARGO_TARGET_DIR:-target}/release/plan-epochs" "$@"
setup_venv >/dev/null
"$LAKECACHE_VENV/bin/python" -c 'import matplotlib' 2>/dev/null ||
  "$LAKECACHE_VENV/bin/pip" install -q matplotlib
"$LAKECACHE_VENV/bin/python" benches/plans/plot.py benches/results/plan-epochs.json
