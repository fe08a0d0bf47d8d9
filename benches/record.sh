#!/usr/bin/env bash
# Runs a benchmark command and records what it printed, as printed, under
# a header naming the command, the commit and the machine:
#   benches/record.sh benches/results/ring.md -- target/release/ring-report
# The output is also shown as it comes. Fails (and writes nothing) if the
# command fails.
set -euo pipefail
[ "$#" -ge 3 ] && [ "$2" = "--" ] || { echo "usage: $0 OUT.md -- COMMAND [ARGS...]" >&2; exit 2; }
out=$1
shift 2
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
"$@" | tee "$tmp"
commit=$(git -C "$(dirname "$0")" rev-parse HEAD 2>/dev/null || echo unknown)
git -C "$(dirname "$0")" diff --quiet HEAD 2>/dev/null || commit="$commit with uncommitted changes"
{
  printf 'Command: `%s`\n' "$*"
  printf 'Commit: %s\n' "$commit"
  printf 'Machine: %s cores (%s), %s GiB, kernel %s\n' "$(nproc)" \
    "$(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo)" \
    "$(awk '/^MemTotal:/ {printf "%.0f", $2 / 1048576}' /proc/meminfo)" "$(uname -r)"
  printf 'Recorded: %s UTC\n\n' "$(date -u '+%Y-%m-%d %H:%M')"
  cat "$tmp"
} >"$out"
echo "recorded in $out" >&2
