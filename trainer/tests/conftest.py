"""A real lakecache cluster for the tests: `lakecache up` (embedded S3, a
worker, FUSE) from the binary in $LAKECACHE_BIN, one per test module.
Every child's output is kept and shown when a test fails (testproc)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

# The shared process helpers (scripts/testsupport/testproc.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "testsupport"))
import testproc  # noqa: E402
from testproc import pytest_runtest_makereport, pytest_runtest_setup  # noqa: E402, F401
from trainenv import BIN  # noqa: E402


@pytest.fixture(scope="module")
def mount(tmp_path_factory):
    d = tmp_path_factory.mktemp("lakecache")
    mnt = d / "mnt"
    up = testproc.Child(
        "lakecache up",
        [
            BIN,
            "up",
            "--dir",
            str(d / "data"),
            "--mount",
            str(mnt),
            "--s3-listen",
            "127.0.0.1:0",
            "--listen",
            "127.0.0.1:0",
            "--cache-size",
            "2GiB",
        ],
    )
    up.wait_for_line("try:", secs=120)
    worker = None
    token_file = None
    for line in up.text().splitlines():
        if line.strip().startswith("worker"):
            worker = line.split()[1].removeprefix("http://")
        if line.strip().startswith("token file"):
            token_file = line.split()[2]
        if line.strip().startswith("S3 endpoint"):
            (mnt.parent / "s3-endpoint").write_text(line.split()[2])
    assert worker and token_file, f"lakecache up did not say where it serves\n{up.describe()}"
    yield mnt, worker, token_file
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(timeout=testproc.scaled(60)) == 0, up.describe()
