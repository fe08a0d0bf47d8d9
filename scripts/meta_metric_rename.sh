#!/usr/bin/env bash
# Meta-test of the test suite: in a scratch copy of this tree, renames two
# metrics the tests rely on (the worker's cache-miss counter and its
# request-duration histogram), builds, and runs the tests that read them.
# Each must FAIL, naming the missing metric: a renamed metric can never
# turn a check into one that passes on 0. Exits 0 only if every one failed
# that way. Not in the test command (it rebuilds the workspace crates,
# about 10 minutes on 2 cores); run it when changing how tests read
# metrics:   scripts/meta_metric_rename.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
echo "meta-test at $(git rev-parse --short HEAD)$(git diff --quiet || echo '+changes') on $(uname -n), $(nproc) cores"

scratch=$(mktemp -d /tmp/lakecache-meta-XXXXXX)
tree=$PWD
# The scratch build shares the target directory, and cargo names a
# workspace crate's artifacts alike wherever the workspace lies: the renamed
# build's artifacts then look fresh to this tree (its sources are older).
# On the way out, the changed file is touched here and this tree rebuilt.
restore() {
  rm -rf "$scratch"
  touch "$tree/cache-worker/src/metrics.rs"
  (cd "$tree" && cargo build --locked -q -p lakecache --bin lakecache)
  if grep -q lakecache_renamed_ "${CARGO_TARGET_DIR:-$tree/target}/debug/lakecache"; then
    echo "error: the lakecache binary still has the renamed metrics; run cargo clean -p lakecache-worker" >&2
    exit 1
  fi
}
trap restore EXIT
# Tracked files as they are now (uncommitted edits included).
git ls-files -z | xargs -0 cp --parents -t "$scratch"
cd "$scratch"
metrics=cache-worker/src/metrics.rs
sed -i 's/"lakecache_cache_miss"/"lakecache_renamed_cache_miss"/; s/"lakecache_request_duration"/"lakecache_renamed_request_duration"/' "$metrics"
grep -q '"lakecache_renamed_cache_miss"' "$metrics" && grep -q '"lakecache_renamed_request_duration"' "$metrics" || {
  echo "error: the metric names to rename are no longer in $metrics; update this script" >&2
  exit 1
}

# test binary, test name, what its failure must say
cases=(
  "cluster written_segments_are_handed_to_their_owners_and_read_without_s3 no worker exports a metric named lakecache_cache_miss"
  "cluster load_spreads_over_the_ring_resumes_and_leaves_reads_to_the_cache no worker exports a metric named lakecache_cache_miss"
  "mount reads_objects_from_s3_and_lists_prefixes_like_a_filesystem metric lakecache_request_duration_seconds_count{op=\"stat\"} is not in the scrape"
  "mount local_tier::a_written_back_file_read_while_pending_stays_in_the_tier_after_its_upload is not in the scrape"
)
cargo test --locked -p lakecache --test cluster --test mount --no-run 2>&1 | tail -1
bad=0
for c in "${cases[@]}"; do
  read -r bin name want <<<"$c"
  out=$(cargo test --locked -q -p lakecache --test "$bin" -- --exact "$name" 2>&1) && status=0 || status=$?
  if [ "$status" -ne 0 ] && grep -qF -- "$want" <<<"$out"; then
    echo "caught: $bin::$name fails with: $(grep -F -- "$want" <<<"$out" | head -1 | cut -c1-160)"
  else
    echo "NOT CAUGHT: $bin::$name (exit $status) did not fail with '$want'; its output:" >&2
    tail -30 <<<"$out" >&2
    bad=1
  fi
done
[ "$bad" -eq 0 ] && echo "meta-test passed: every renamed metric was caught"
exit "$bad"
