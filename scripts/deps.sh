#!/usr/bin/env bash
# Installs what building and testing lakecache needs on Debian/Ubuntu.
# Idempotent and quiet when everything is already there.
set -euo pipefail

need_apt=()
# bindgen (rocksdb bindings) needs libclang; the C++ build needs g++;
# etcd-client needs protoc; the cluster tests run a real etcd; the mount
# needs fusermount3 (fuse3) and its tests and benchmarks run fio; TLS
# tests make their certificates with openssl; the POSIX tests copy trees
# with rsync; a real Prometheus scrapes a worker and a mount and loads the
# alert rules.
for pkg in libclang-dev clang g++ pkg-config protobuf-compiler etcd-server fuse3 fio openssl rsync prometheus; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
# `kubectl kustomize` renders the Kubernetes overlays in the tests.
command -v kubectl >/dev/null 2>&1 || need_apt+=(kubernetes-client)
if ((${#need_apt[@]})); then
  echo "installing: ${need_apt[*]}" >&2
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null 2>&1; then
  for c in "$HOME/.cargo/bin/cargo" /usr/local/cargo/bin/cargo; do
    [ -x "$c" ] && export PATH="$(dirname "$c"):$PATH" && break
  done
fi
command -v cargo >/dev/null 2>&1 || {
  echo "error: cargo not found; install Rust 1.95+ (https://rustup.rs)" >&2
  exit 1
}

# Reuse a build cache outside the checkout when one can be made.
if [ -z "${CARGO_TARGET_DIR:-}" ]; then
  if mkdir -p /var/cache/lakecache/target 2>/dev/null && [ -w /var/cache/lakecache/target ]; then
    export CARGO_TARGET_DIR=/var/cache/lakecache/target
  fi
fi

# The trainer's Python environment (torch, DeepSpeed, transformers),
# reused across runs like the cargo target directory.
setup_venv() {
  if [ -z "${LAKECACHE_VENV:-}" ]; then
    if mkdir -p /var/cache/lakecache 2>/dev/null && [ -w /var/cache/lakecache ]; then
      LAKECACHE_VENV=/var/cache/lakecache/venv
    else
      LAKECACHE_VENV="$PWD/.venv"
    fi
  fi
  export LAKECACHE_VENV
  if [ ! -x "$LAKECACHE_VENV/bin/python" ]; then
    python3 -m venv "$LAKECACHE_VENV"
  fi
  "$LAKECACHE_VENV/bin/pip" install -q "maturin>=1.7,<2"
  # The Python client (PyO3 over the Rust cluster client), built by maturin
  # into the venv; the trainer's loader lives in it.
  (cd pyclient && VIRTUAL_ENV="$LAKECACHE_VENV" "$LAKECACHE_VENV/bin/maturin" develop -q --strip)
  "$LAKECACHE_VENV/bin/pip" install -q -e "trainer[test]" -r ops/tests/requirements.txt
}
