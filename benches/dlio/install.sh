#!/usr/bin/env bash
# Installs MLPerf Storage's DLIO benchmark into a cached venv of its own
# (LAKECACHE_DLIO_VENV, default /var/cache/lakecache/venv-dlio), beside
# the trainer's venv, which it reuses for torch (a .pth file), so the
# multi-GB CUDA wheels are not installed twice. Idempotent: a venv whose
# `import dlio_benchmark` works is left alone.
#
# Snags handled (issue #34):
# - dlio-benchmark declares nvidia-dali-cuda110, a registry stub that
#   cannot install offline: installed with --no-deps, then the modules it
#   imports are added by hand;
# - the mpi4py wheel wants libmpi.so.12, which Debian's MPICH does not
#   ship under that name: built from source against mpich/libmpich-dev;
# - it imports tensorflow at start-up even for PyTorch workloads:
#   tensorflow-cpu.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/deps.sh >/dev/null
setup_venv >/dev/null
DLIO_VENV="${LAKECACHE_DLIO_VENV:-$(dirname "$LAKECACHE_VENV")/venv-dlio}"
export DLIO_VENV

# The Python client for the DLIO reader plugin: a release wheel installed
# into this venv itself. The trainer's venv holds an editable debug build
# whose native module lives in the checkout (pyclient/python/lakecache/);
# `maturin develop` here would overwrite that file, and the two venvs
# would rebuild over each other on every run. Built on every run: cargo
# rebuilds only what changed, so an unchanged client costs a few seconds.
install_pyclient() {
  local wheels="$DLIO_VENV/lakecache-wheel"
  rm -rf "$wheels"
  (cd pyclient && "$LAKECACHE_VENV/bin/maturin" build -q --release --strip \
    --compatibility linux -i "$DLIO_VENV/bin/python" -o "$wheels" >&2)
  "$DLIO_VENV/bin/pip" install -q --disable-pip-version-check --no-deps --force-reinstall \
    "$wheels"/lakecache-*.whl >&2
  pyclient_here || {
    echo "error: the Python client installed into $DLIO_VENV is not the one it imports" >&2
    exit 1
  }
}
# DLIO's TFRecord generator (ResNet-50) runs DALI's `tfrecord2idx` to
# index each file; DALI is CUDA-only. The index is one "offset length"
# line per record, which this writes.
install_tfrecord2idx() {
  cat > "$DLIO_VENV/bin/tfrecord2idx" <<'PY'
#!/usr/bin/env python3
"""tfrecord2idx SRC DST: one "offset length" line per TFRecord record."""
import struct
import sys

src, dst = sys.argv[1], sys.argv[2]
with open(src, "rb") as f, open(dst, "w") as out:
    while head := f.read(8):
        start = f.tell() - 8
        (length,) = struct.unpack("<Q", head)
        f.seek(4 + length + 4, 1)  # length CRC, data, data CRC
        out.write(f"{start} {f.tell() - start}\n")
PY
  chmod +x "$DLIO_VENV/bin/tfrecord2idx"
}
pyclient_here() {
  "$DLIO_VENV/bin/python" -c 'import lakecache, sys; sys.exit(not lakecache.__file__.startswith(sys.prefix))' 2>/dev/null
}

if [ -x "$DLIO_VENV/bin/python" ] && "$DLIO_VENV/bin/python" -c 'import dlio_benchmark, mpi4py.MPI, tensorflow, torch, matplotlib' 2>/dev/null; then
  install_pyclient
  [ -x "$DLIO_VENV/bin/tfrecord2idx" ] || install_tfrecord2idx
  echo "$DLIO_VENV"
  exit 0
fi

if ! command -v mpirun >/dev/null || ! dpkg -s libmpich-dev >/dev/null 2>&1; then
  echo "installing MPICH (apt-get)" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q mpich libmpich-dev >&2
fi

python3 -m venv "$DLIO_VENV"
# torch (and its CUDA wheels) from the trainer's venv, after this venv's
# own packages on sys.path.
trainer_site=$("$LAKECACHE_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
dlio_site=$("$DLIO_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$trainer_site" > "$dlio_site/zz-lakecache-trainer-venv.pth"

pip=("$DLIO_VENV/bin/pip" install -q --disable-pip-version-check)
"${pip[@]}" "dlio-benchmark==2.0.0" --no-deps >&2
"${pip[@]}" "Pillow>=9.3" "PyYAML>=6" "h5py>=3.11" "numpy>=1.26" \
  "omegaconf>=2.2" "pandas>=1.5" "psutil>=5.9.8" "pydftracer==1.0.2" \
  "hydra-core>=1.3.2" "tensorflow-cpu>=2.16" matplotlib >&2
MPICC=mpicc "${pip[@]}" --no-binary mpi4py --no-cache-dir "mpi4py>=3.1.4" >&2
install_pyclient
install_tfrecord2idx
"$DLIO_VENV/bin/python" -c 'import dlio_benchmark, mpi4py.MPI, tensorflow, torch, matplotlib' >&2
echo "$DLIO_VENV"
