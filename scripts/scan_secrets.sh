#!/usr/bin/env bash
# Fails when a test run's log holds a secret: a whole access token, a
# signing-key line, or one of the fixed S3 secrets and etcd passwords the
# tests configure. Usage: scripts/scan_secrets.sh LOG...
set -euo pipefail
patterns=(
  'lct1\.[A-Za-z0-9_-]{40,}\.[A-Za-z0-9_-]{40,}'
  'lakecache-key-v1 [^ ]+ [A-Za-z0-9_-]{40,}'
  'mount-test-secret|cluster-test-secret|test-secret-key|bench-secret'
  'lc-pass-for-tests|root-pass-for-tests'
)
found=0
for p in "${patterns[@]}"; do
  if hits=$(grep -Eao "$p" "$@" | head -3) && [ -n "$hits" ]; then
    echo "secret scan: pattern /$p/ matched in the test log (first matches redacted to their length):" >&2
    while IFS= read -r h; do echo "  ${#h} characters" >&2; done <<<"$hits"
    found=1
  fi
done
exit "$found"
