#!/usr/bin/env bash
# Runs the cluster and mount test binaries N times in a row beside a CPU
# and disk hog (`stress-ng --cpu 2 --hdd 1`), the flake hunt of issue #30,
# and prints one line per iteration (passed, failed, minutes) and a total.
# A failing iteration's output is kept in the log directory it names.
#
#   scripts/soak_under_load.sh [N=20] [-- extra cargo test arguments]
#
# Not in the test command (about 6 minutes per iteration on 2 cores).
# Builds the test binaries first, without the hog, so every iteration runs
# the same build. Exits non-zero if any iteration failed.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
n=${1:-20}
shift || true
[ "${1:-}" = "--" ] && shift
[[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "error: N must be a positive whole number, got '$n'" >&2; exit 2; }
command -v stress-ng >/dev/null || {
  echo "error: stress-ng not found; install it: apt-get install -y stress-ng" >&2
  exit 2
}
tests=(--test cluster --test mount)
cargo test --locked --no-run -q -p lakecache "${tests[@]}"
logs=$(mktemp -d /tmp/lakecache-soak-XXXXXX)
# Its scratch files go with the logs, not into the checkout.
stress-ng --cpu 2 --hdd 1 --temp-path "$logs" --quiet &
hog=$!
trap 'kill $hog 2>/dev/null || true; wait $hog 2>/dev/null || true' EXIT
echo "soak at $(git rev-parse --short HEAD)$(git diff --quiet || echo '+changes'): $n iterations beside stress-ng --cpu 2 --hdd 1; logs in $logs"
bad=0
for i in $(seq 1 "$n"); do
  log="$logs/iteration-$i.log"
  start=$SECONDS
  set +e
  cargo test --locked --no-fail-fast -p lakecache "${tests[@]}" "$@" >"$log" 2>&1
  status=$?
  set -e
  read -r passed failed < <(awk '/^test result:/ {
      for (i = 2; i <= NF; i++) { if ($i ~ /^passed;?$/) p += $(i-1); if ($i ~ /^failed;?$/) f += $(i-1) }
    } END { print p + 0, f + 0 }' "$log")
  if [ "$status" -ne 0 ] && [ "$failed" -eq 0 ]; then
    failed=1  # the build or a binary failed before reporting
  fi
  mins=$(( (SECONDS - start) / 60 ))m$(printf '%02d' $(( (SECONDS - start) % 60 )))s
  if [ "$failed" -eq 0 ]; then
    echo "iteration $i: $passed passed, 0 failed, $mins"
    rm -f "$log"
  else
    bad=$((bad + 1))
    echo "iteration $i: $passed passed, $failed FAILED, $mins (log: $log)"
    grep -E '^test .* FAILED$|^    [a-z_:]+$' "$log" | sort -u | sed 's/^/    /' || true
  fi
done
echo "soak: $((n - bad)) of $n iterations clean"
[ "$bad" -eq 0 ]
