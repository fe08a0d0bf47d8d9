"""Process helpers shared by the operations tests: the shared testproc
module (logs kept and shown on failure, ports reported by the children,
deadlines scaled by LAKECACHE_TEST_TIME_SCALE) plus what these tests add."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import testproc  # on sys.path by conftest.py

wait_for = testproc.wait_for


def lakecache_bin() -> str:
    path = os.environ.get("LAKECACHE_BIN")
    if not path or not Path(path).exists():
        pytest.fail("LAKECACHE_BIN must point at a built lakecache binary")
    return path


def start_s3(binary: str, root: Path, env: dict[str, str] | None = None):
    """`lakecache s3-server` with bucket `data`, credentials unit-test;
    (child, port)."""
    return testproc.start_s3_server(binary, root, "unit-test", "unit-test-secret", env)


def start_worker(binary: str, cache: Path, s3_port: int, env: dict[str, str]):
    """A plain-HTTP worker without tokens over the S3 endpoint on `s3_port`;
    (child, port)."""
    return testproc.start_plain_worker(binary, cache, s3_port, env)


def stop_all(children) -> None:
    for c in reversed(children):
        c.stop()


S3_ENV = {
    "AWS_ACCESS_KEY_ID": "unit-test",
    "AWS_SECRET_ACCESS_KEY": "unit-test-secret",
    "AWS_REGION": "us-east-1",
}
