"""The data lake and the readers' daemons for the DLIO bench: the S3
endpoint, the delay proxy in front of it, and a lakecache worker and
mount (or s3fs) started fresh for each run."""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from cgroup import BenchError, Cgroup
from run import (
    ACCESS,
    BUCKET,
    SECRET,
    die_with_parent,
    free_port,
    mounted,
    s3_env,
    start_s3_server,
    wait_port,
)

GIB = 1 << 30
# The mount's memory budget in the bench (`--memory-limit`), and what the
# daemons' cgroup allows beside it: the worker's and the mount's own
# memory, and a little page cache.
MOUNT_BUDGET = GIB // 2
DAEMONS_MEMORY = MOUNT_BUDGET + GIB


@dataclass
class Lake:
    """The S3 endpoint (for the whole run), the delay proxy in front of it
    at the current RTT, and whichever reader's daemons run."""

    a: argparse.Namespace
    work: Path
    daemons_cg: Cgroup
    # The S3 endpoint's own cgroup, when its page cache is capped.
    endpoint_cg: Cgroup | None = None
    procs: list[subprocess.Popen] = field(default_factory=list)
    proxy: subprocess.Popen | None = None
    rtt_ms: int = 0

    def __post_init__(self) -> None:
        self.env = s3_env()
        self.s3, self.s3_port = start_s3_server(
            self.a.bin,
            self.work / "s3",
            self.log("s3-server"),
            self.env,
            self.endpoint_cg.prefix() if self.endpoint_cg else None,
        )
        self.url = f"http://127.0.0.1:{self.s3_port}"
        self.mnt = self.work / "mnt"
        self.mnt.mkdir(exist_ok=True)
        self.worker_port = 0
        self.mount_metrics: str | None = None

    def log(self, role: str):
        return open(self.work / f"{role}.log", "a")

    def set_rtt(self, rtt_ms: int) -> None:
        if self.proxy:
            self.proxy.send_signal(signal.SIGTERM)
            self.proxy.wait(timeout=30)
            self.proxy = None
        self.rtt_ms = rtt_ms
        self.url = f"http://127.0.0.1:{self.s3_port}"
        if rtt_ms:
            port = free_port()
            self.proxy = subprocess.Popen(
                [
                    self.a.proxy,
                    "--listen",
                    f"127.0.0.1:{port}",
                    "--upstream",
                    f"127.0.0.1:{self.s3_port}",
                    "--rtt-ms",
                    str(rtt_ms),
                ],
                stdout=subprocess.DEVNULL,
                stderr=self.log("proxy"),
                preexec_fn=die_with_parent,
            )
            wait_port(port)
            self.url = f"http://127.0.0.1:{port}"

    def spawn(self, args: list[str], role: str) -> subprocess.Popen:
        p = subprocess.Popen(
            self.daemons_cg.prefix() + args,
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=self.log(role),
            preexec_fn=die_with_parent,
        )
        self.procs.append(p)
        return p

    def start_lakecache(
        self, tier: bool, write_mode: str = "through", tier_whole: bool = False
    ) -> None:
        """A fresh worker (empty cache) and a mount wired as `lakecache up`
        wires them (the worker's local socket). `tier_whole`: the dataset
        directory is fetched whole into the tier on open
        (`--local-cache-whole dlio/`)."""
        cache, tier_dir = self.work / "cache", self.work / "tier"
        for d in (cache, tier_dir):
            if d.exists():
                shutil.rmtree(d)
        self.worker_port = free_port()
        self.spawn(
            [
                self.a.bin,
                "worker",
                "--insecure-http",
                "--no-auth",
                "--listen",
                f"127.0.0.1:{self.worker_port}",
                "--cache-dir",
                str(cache),
                "--cache-size",
                "16GiB",
                "--s3-endpoint",
                self.url,
                "--s3-path-style",
                *getattr(self.a, "worker_arg", []),
            ],
            "worker",
        )
        wait_port(self.worker_port)
        flags = ["--local-cache", str(tier_dir), "--local-cache-size", "16GiB"] if tier else []
        self.mount_metrics = None
        if tier:
            # Its listener serves the tier's report (tier_state, after a run).
            self.mount_metrics = f"127.0.0.1:{free_port()}"
            flags += ["--metrics-listen", self.mount_metrics]
        if tier and tier_whole:
            flags += ["--local-cache-whole", "dlio/"]
        self.spawn(
            [
                self.a.bin,
                "mount",
                f"s3://{BUCKET}",
                str(self.mnt),
                "--worker",
                f"127.0.0.1:{self.worker_port}",
                "--no-s3-fallback",
                "--local-worker-socket",
                str(cache / "local.sock"),
                "--write-mode",
                write_mode,
                "--memory-limit",
                str(MOUNT_BUDGET),
                *flags,
                *getattr(self.a, "mount_arg", []),
            ],
            "mount",
        )
        self._wait_mounted("mount")

    def start_s3fs(self) -> None:
        cache = self.work / "s3fs-cache"
        if cache.exists():
            shutil.rmtree(cache)
        cache.mkdir()
        passwd = self.work / "s3fs-passwd"
        passwd.write_text(f"{ACCESS}:{SECRET}\n")
        passwd.chmod(0o600)
        self.spawn(
            [
                "s3fs",
                BUCKET,
                str(self.mnt),
                "-f",
                "-o",
                f"url={self.url},use_path_request_style,passwd_file={passwd},"
                f"endpoint=us-east-1,listobjectsv2,ro,use_cache={cache}",
            ],
            "s3fs",
        )
        self._wait_mounted("s3fs")

    def tier_state(self) -> dict | None:
        """What the mount's node-local tier holds now (whole and partial
        objects, bytes missing, fills dropped, completion's fetches), from
        `lakecache status --mount ADDR --json`; None without a tier."""
        if not self.mount_metrics:
            return None
        out = subprocess.run(
            [self.a.bin, "status", "--mount", self.mount_metrics, "--json"],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=60,
        )
        if out.returncode != 0:
            print(f"the mount's tier report failed: {out.stderr.strip()}", flush=True)
            return None
        r = json.loads(out.stdout)
        return {
            "whole": r["whole"],
            "partial": r["partial"],
            "missing_bytes": r["missing_bytes"],
            "fill_dropped_bytes": r["fill_dropped_bytes"],
            "fill_waited_bytes": r.get("fill_waited_bytes", 0),
            "completion_fetched_bytes": r["completion"]["fetched_bytes"],
        }

    def _wait_mounted(self, role: str) -> None:
        deadline = time.time() + 60
        while not mounted(self.mnt):
            dead = [p for p in self.procs if p.poll() is not None]
            if dead or time.time() > deadline:
                raise BenchError(f"{role} did not mount {self.mnt}; see {self.work / role}.log")
            time.sleep(0.05)

    def daemon_pids(self) -> list[int]:
        """The serving processes (the sh prefix execs them: same pids)."""
        return [p.pid for p in self.procs if p.poll() is None]

    def stop_daemons(self) -> None:
        if mounted(self.mnt):
            subprocess.run(
                ["fusermount3", "-u", str(self.mnt)], check=False, stderr=subprocess.DEVNULL
            )
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs = []
        # The next reader may be no lakecache mount: ask it for no tier report.
        self.mount_metrics = None
        if mounted(self.mnt):
            subprocess.run(["umount", "-l", str(self.mnt)], check=False)

    def close(self) -> None:
        self.stop_daemons()
        self.set_rtt(0)
        self.s3.send_signal(signal.SIGTERM)
        self.s3.wait(timeout=60)
