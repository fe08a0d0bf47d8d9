#!/usr/bin/env bash
# The DLIO (MLPerf Storage) bench in one command: builds the release
# binaries, installs DLIO and MPICH (install.sh), then runs dlio_bench.py.
#   benches/dlio/run.sh            # the whole matrix (under an hour here)
#   benches/dlio/run.sh --quick    # UNet3D only, fewer files (under 10 min)
# Other dlio_bench.py flags pass through (--readers, --rtt-ms, --work, ...).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/deps.sh
cargo build --release --locked -q --bin lakecache --bin delay-proxy
venv=$(benches/dlio/install.sh | tail -n 1)
target="${CARGO_TARGET_DIR:-$PWD/target}/release"
exec "$venv/bin/python" benches/dlio/dlio_bench.py --bin "$target/lakecache" \
  --proxy "$target/delay-proxy" "$@"
