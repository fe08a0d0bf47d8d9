#!/usr/bin/env bash
# Builds lakecache and starts a single-node cluster: an embedded S3
# endpoint with a bucket and a cache worker in front of it. Ctrl-C stops it.
# Extra arguments go to `lakecache up` (see `lakecache up --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
cargo build --release --locked --bin lakecache
exec "${CARGO_TARGET_DIR:-target}/release/lakecache" up "$@"
