"""Environment shared by the trainer's tests."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

BIN = os.environ.get("LAKECACHE_BIN", "lakecache")
# The checkpoint signing key lives on local disk, never on the mount.
KEY_FILE = Path(tempfile.mkdtemp(prefix="lakecache-ckpt-key-")) / "key"
KEY_FILE.write_bytes(os.urandom(32).hex().encode())
# DeepSpeed JIT-builds its CPU ops with the venv's ninja.
ENV = {
    **os.environ,
    "DS_ACCELERATOR": "cpu",
    "OMP_NUM_THREADS": "1",
    "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
    "LAKECACHE_CHECKPOINT_KEY_FILE": str(KEY_FILE),
}
