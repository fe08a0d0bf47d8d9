#!/usr/bin/env bash
# Runs every test of the project: format, lints, unit and integration tests.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh

echo "== cargo fmt --check" >&2
cargo fmt --all -- --check
echo "== cargo clippy" >&2
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== cargo test" >&2
cargo test --workspace --locked --no-fail-fast
