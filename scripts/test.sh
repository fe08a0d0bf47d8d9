#!/usr/bin/env bash
# Runs every test of the project: format, lints, unit and integration tests.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
source scripts/test_prereqs.sh
check_test_prereqs

# Wall time of each phase, printed again at the end.
phase_times=()
phase_name=""
phase_start=$SECONDS
run_started=$SECONDS
phase() {
  if [ -n "$phase_name" ]; then
    phase_times+=("$(printf '%-28s %4dm%02ds' "$phase_name" $(((SECONDS - phase_start) / 60)) $(((SECONDS - phase_start) % 60)))")
  fi
  phase_name="$1"
  phase_start=$SECONDS
  [ -n "$1" ] && echo "== $1" >&2
  return 0
}

phase "cargo fmt --check"
cargo fmt --all -- --check
phase "cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
phase "cargo test"
log=$(mktemp)
set +e
cargo test --workspace --locked --no-fail-fast 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
# Secrets never reach a log, even of a test that prints what it saw.
leaks=0
scripts/scan_secrets.sh "$log" || leaks=1
# One closing line over every test binary (cargo prints one per binary).
read -r passed failed < <(awk '/^test result:/ {
    for (i = 2; i <= NF; i++) { if ($i ~ /^passed;?$/) p += $(i-1); if ($i ~ /^failed;?$/) f += $(i-1) }
  } END { print p + 0, f + 0 }' "$log")
if [ "$leaks" -ne 0 ]; then
  status=1
  failed=$((failed + 1))  # the secret scan counts as a failed check
fi

phase "python: venv, ruff, pytest"
set +e
(
  set -e
  setup_venv
  cd trainer
  "$LAKECACHE_VENV/bin/ruff" check .
  "$LAKECACHE_VENV/bin/ruff" format --check .
  # The POSIX conformance suite and the benchmark scripts, same rules.
  "$LAKECACHE_VENV/bin/ruff" check --config pyproject.toml ../cli/tests/posix ../benches/fio ../benches/dlio ../benches/plans ../ops/tests ../pyclient/python ../scripts/testsupport
  "$LAKECACHE_VENV/bin/ruff" format --check --config pyproject.toml ../benches/dlio ../benches/plans ../ops/tests ../pyclient/python ../scripts/testsupport
  LAKECACHE_BIN="${CARGO_TARGET_DIR:-$PWD/../target}/debug/lakecache" \
    PATH="$LAKECACHE_VENV/bin:$PATH" "$LAKECACHE_VENV/bin/pytest" -q -rA
  # Operations: Kubernetes manifests, systemd units, traces end to end.
  LAKECACHE_BIN="${CARGO_TARGET_DIR:-$PWD/../target}/debug/lakecache" \
    "$LAKECACHE_VENV/bin/pytest" -q -rA -p no:cacheprovider ../ops/tests
) 2>&1 | tee "$log"
py_status=${PIPESTATUS[0]}
scripts/scan_secrets.sh "$log" || py_status=1
set -e
read -r py_passed py_failed < <(awk '/^PASSED / {p++} /^(FAILED|ERROR) / {f++} END { print p + 0, f + 0 }' "$log")
if [ "$py_status" -ne 0 ] && [ "$py_failed" -eq 0 ]; then
  py_failed=1  # venv, lint or collection failed before any test
fi
passed=$((passed + py_passed))
failed=$((failed + py_failed))
[ "$py_status" -eq 0 ] || status=1
rm -f "$log"
phase ""
echo "time by phase:"
printf '  %s\n' "${phase_times[@]}"
printf '  %-28s %4dm%02ds\n' "total" $(((SECONDS - run_started) / 60)) $(((SECONDS - run_started) % 60))
if [ "$passed" -eq 0 ]; then
  echo "error: no test ran" >&2
  exit 1
fi
echo "summary: $passed passed, $failed failed"
exit "$status"
