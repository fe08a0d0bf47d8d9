#!/usr/bin/env bash
# What the test command needs before any test runs. Each missing piece
# stops the run here, naming it and how to install it, instead of failing
# somewhere inside a test. Sourced by scripts/test.sh after deps.sh.

check_test_prereqs() {
  local missing=()
  [ -c /dev/fuse ] || missing+=("/dev/fuse: the FUSE device (load the fuse module: modprobe fuse; in a container pass --device /dev/fuse --cap-add SYS_ADMIN)")
  command -v fusermount3 >/dev/null 2>&1 || missing+=("fusermount3: apt-get install fuse3")
  command -v etcd >/dev/null 2>&1 || missing+=("etcd: apt-get install etcd-server")
  command -v fio >/dev/null 2>&1 || missing+=("fio: apt-get install fio")
  [ -x /usr/bin/prometheus ] || missing+=("/usr/bin/prometheus: apt-get install prometheus")
  command -v rsync >/dev/null 2>&1 || missing+=("rsync: apt-get install rsync")
  command -v python3 >/dev/null 2>&1 || missing+=("python3: apt-get install python3 python3-venv")
  # Children bind port 0 on loopback and report what they got.
  if ! python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()' 2>/dev/null; then
    missing+=("a free loopback TCP port: binding 127.0.0.1:0 failed (is the loopback interface up? ip link set lo up)")
  fi
  # One factor multiplies every deadline in the tests.
  if [ -n "${LAKECACHE_TEST_TIME_SCALE+x}" ]; then
    if ! [[ "$LAKECACHE_TEST_TIME_SCALE" =~ ^[0-9]*\.?[0-9]+$ ]] \
      || ! awk -v f="$LAKECACHE_TEST_TIME_SCALE" 'BEGIN { exit !(f > 0) }'; then
      missing+=("LAKECACHE_TEST_TIME_SCALE=$LAKECACHE_TEST_TIME_SCALE: must be a positive number such as 2 or 0.5 (it multiplies every test deadline)")
    fi
  fi
  if ((${#missing[@]})); then
    echo "error: the tests cannot run on this machine yet:" >&2
    printf '  - %s\n' "${missing[@]}" >&2
    return 1
  fi
}
