"""Process helpers shared by the operations tests."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest


def lakecache_bin() -> str:
    path = os.environ.get("LAKECACHE_BIN")
    if not path or not Path(path).exists():
        pytest.fail("LAKECACHE_BIN must point at a built lakecache binary")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, ok, secs: float = 30.0) -> None:
    deadline = time.monotonic() + secs
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_s3(
    binary: str, root: Path, port: int, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`lakecache s3-server` with bucket `data`, credentials unit-test."""
    proc = subprocess.Popen(
        [binary, "s3-server", "--root", str(root), "--listen", f"127.0.0.1:{port}",
         "--access-key", "unit-test", "--secret-key", "unit-test-secret", "--bucket", "data"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    wait_for("the s3 endpoint", lambda: port_open(port))
    return proc


def start_worker(
    binary: str, cache: Path, port: int, s3_port: int, env: dict[str, str]
) -> subprocess.Popen:
    """A plain-HTTP worker without tokens over the S3 endpoint on `s3_port`."""
    proc = subprocess.Popen(
        [binary, "worker", "--listen", f"127.0.0.1:{port}", "--insecure-http", "--no-auth",
         "--cache-dir", str(cache), "--cache-size", "1GiB",
         "--s3-endpoint", f"http://127.0.0.1:{s3_port}", "--s3-path-style"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    wait_for("the worker", lambda: port_open(port))
    return proc


S3_ENV = {
    "AWS_ACCESS_KEY_ID": "unit-test",
    "AWS_SECRET_ACCESS_KEY": "unit-test-secret",
    "AWS_REGION": "us-east-1",
}
