"""A real lakecache cluster for the tests: `lakecache up` (embedded S3, a
worker, FUSE) from the binary in $LAKECACHE_BIN, one per test module."""

from __future__ import annotations

import signal
import subprocess

import pytest
from trainenv import BIN


@pytest.fixture(scope="module")
def mount(tmp_path_factory):
    d = tmp_path_factory.mktemp("lakecache")
    mnt = d / "mnt"
    proc = subprocess.Popen(
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
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    worker = None
    token_file = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip().startswith("worker"):
            worker = line.split()[1].removeprefix("http://")
        if line.strip().startswith("token file"):
            token_file = line.split()[2]
        if line.strip().startswith("S3 endpoint"):
            (mnt.parent / "s3-endpoint").write_text(line.split()[2])
        if line.startswith("try:"):
            break
    assert worker and token_file, "lakecache up did not start"
    yield mnt, worker, token_file
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
