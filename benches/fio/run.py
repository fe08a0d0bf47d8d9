#!/usr/bin/env python3
"""fio through a lakecache mount (cold and warm cache) and on local disk,
in one session on one machine; writes benches/results/fio.md.

Usage (as root, release binary built):
    python3 benches/fio/run.py --bin target/release/lakecache --work /var/tmp/lc-fio
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import cpu
import provenance
import rounds

HERE = Path(__file__).resolve().parent
ACCESS, SECRET, BUCKET = "fio-bench", "fio-bench-secret", "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int) -> None:
    deadline = time.time() + 30
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise SystemExit(f"port {port} never opened")


def mounted(path: Path) -> bool:
    want = str(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split(" ")[4] == want for line in f)


def remove_work(work: Path) -> None:
    """Deletes a finished run's --work (its datasets are GiBs; several runs
    filled this machine's disk). A failed run never gets here, so it keeps
    the daemons' logs it names. Nothing is deleted while anything under
    `work` is still mounted: rmtree would walk into the mount and delete
    through it."""
    prefix = str(work.resolve()) + "/"
    with open("/proc/self/mountinfo") as f:
        busy = [m for m in (line.split(" ")[4] for line in f) if m.startswith(prefix)]
    if busy:
        print(f"kept {work}: still mounted at {', '.join(busy)}", flush=True)
        return
    shutil.rmtree(work)
    print(f"removed {work} (pass --keep-work to keep it)", flush=True)


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def s3_env() -> dict[str, str]:
    """This environment with the bench endpoint's credentials and region."""
    return {
        **os.environ,
        "AWS_ACCESS_KEY_ID": ACCESS,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_REGION": "us-east-1",
    }


def die_with_parent() -> None:
    """`preexec_fn` for the benches' daemons: the child gets SIGTERM when
    the bench dies, killed with -9 included (no `finally` runs then), so
    no endpoint, worker, mount or proxy outlives it holding its ports,
    mount point and files for the next run to trip over."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def start_s3_server(
    binary: str,
    root: Path,
    stderr,
    env: dict[str, str] | None = None,
    prefix: list[str] | None = None,
):
    """`lakecache s3-server` over `root` with the bench bucket, on a port
    from the OS; returns the process and its port once it answers.
    `prefix` wraps the command (a cgroup's, for one)."""
    port = free_port()
    proc = subprocess.Popen(
        (prefix or [])
        + [binary, "s3-server", "--root", str(root), "--listen", f"127.0.0.1:{port}",
           "--access-key", ACCESS, "--secret-key", SECRET, "--bucket", BUCKET],
        env=env, stdout=subprocess.DEVNULL, stderr=stderr, preexec_fn=die_with_parent,
    )
    wait_port(port)
    return proc, port


class Cluster:
    """s3-server, one worker and a mount, as processes."""

    def __init__(self, binary: str, work: Path) -> None:
        self.bin, self.work = binary, work
        self.env = s3_env()
        self.s3, self.s3_port = start_s3_server(binary, work / "s3", self.log("s3-server"))
        self.worker = self.mount = None
        self.mnt = work / "mnt"
        self.worker_port = free_port()

    def log(self, role: str):
        """Where a child's stderr goes: `<work>/<role>.log`, appended, so
        a failed run can be read afterwards (a bench that fails names it)."""
        return open(self.work / f"{role}.log", "a")

    def start_worker(
        self,
        fresh: bool,
        worker_flags: tuple[str, ...] = ("--insecure-http", "--no-auth"),
        mount_flags: tuple[str, ...] = (),
    ) -> None:
        """Plain HTTP without tokens unless other flags are given (the
        security-overhead bench passes TLS and token flags)."""
        cache = self.work / "cache"
        if fresh and cache.exists():
            shutil.rmtree(cache)
        self.worker = subprocess.Popen(
            [self.bin, "worker", *worker_flags, "--listen", f"127.0.0.1:{self.worker_port}",
             "--cache-dir", str(cache), "--cache-size", "12GiB", "--s3-endpoint",
             f"http://127.0.0.1:{self.s3_port}", "--s3-path-style"],
            env=self.env, stdout=subprocess.DEVNULL, stderr=self.log("worker"),
            preexec_fn=die_with_parent,
        )
        wait_port(self.worker_port)
        # As `lakecache up` wires them: the mount reaches its co-located
        # worker through the worker's local socket too.
        self._mount(("--worker", f"127.0.0.1:{self.worker_port}",
                     "--local-worker-socket", str(cache / "local.sock"), *mount_flags))

    def _mount(self, flags: tuple[str, ...]) -> None:
        self.mount = subprocess.Popen(
            [self.bin, "mount", f"s3://{BUCKET}", str(self.mnt), "--no-s3-fallback", *flags],
            env=self.env, stdout=subprocess.DEVNULL, stderr=self.log("mount"),
            preexec_fn=die_with_parent,
        )
        deadline = time.time() + 30
        while not mounted(self.mnt):
            if time.time() > deadline:
                raise SystemExit("mount did not come up; see mount.log")
            time.sleep(0.05)

    def start_ring(
        self, workers: int, worker_flags: tuple[str, ...], mount_flags: tuple[str, ...]
    ) -> None:
        """`workers` fresh workers that know their ring (static registry),
        plain HTTP without tokens, and a mount over all of them."""
        ports = [self.worker_port] + [free_port() for _ in range(workers - 1)]
        registry = "static:" + ",".join(f"127.0.0.1:{p}" for p in ports)
        self.ring = []
        for i, port in enumerate(ports):
            cache = self.work / f"cache-{i}"
            if cache.exists():
                shutil.rmtree(cache)
            self.ring.append(subprocess.Popen(
                [self.bin, "worker", "--insecure-http", "--no-auth", "--registry", registry,
                 "--listen", f"127.0.0.1:{port}", "--cache-dir", str(cache),
                 "--cache-size", "12GiB", "--s3-endpoint", f"http://127.0.0.1:{self.s3_port}",
                 "--s3-path-style", *worker_flags],
                env=self.env, stdout=subprocess.DEVNULL, stderr=self.log(f"worker-{i}"),
                preexec_fn=die_with_parent,
            ))
            wait_port(port)
        self.worker = self.ring[0]
        # As `lakecache up` wires a ring: the first worker's local socket.
        self._mount(("--registry", registry, "--local-worker-socket",
                     str(self.work / "cache-0" / "local.sock"), *mount_flags))
        self.registry = registry

    def start_write_mode(self, mode: str) -> Path:
        """Workers and a mount for one write mode of the write benches
        (`through`, `back`, `back-streamed`: write-back with staged writes
        off, or `back-r2`: three workers, every write-back body on two of
        them); returns the mode's own directory on the
        mount. The bucket outlives the workers: each mode writes its own
        directory (an existing object opened without O_TRUNC is read-only
        on the mount)."""
        if mode == "back-r2":
            self.start_ring(3, ("--write-replicas", "2"), ("--write-mode", "back"))
        elif mode == "back-streamed":
            self.start_worker(fresh=True, mount_flags=("--write-mode", "back",
                                                       "--staged-writes=false"))
        else:
            self.start_worker(fresh=True, mount_flags=("--write-mode", mode))
        return self.mnt / mode

    def daemons(self) -> list[int]:
        """The lakecache processes serving the mount (not the S3 endpoint),
        whose CPU counts toward a measurement's CPU-s/GiB."""
        procs = [self.mount, self.worker, *getattr(self, "ring", [])]
        return sorted({p.pid for p in procs if p and p.poll() is None})

    def stop_worker(self) -> None:
        for p in (self.mount, self.worker, *getattr(self, "ring", [])):
            if p and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=180)
        self.ring = []

    def close(self) -> None:
        self.stop_worker()
        self.s3.send_signal(signal.SIGTERM)
        self.s3.wait(timeout=60)


def fio(job: str, directory: Path, **env: str) -> dict:
    e = {**os.environ, "LAKECACHE_FIO_DIR": str(directory)}
    e.update({f"LAKECACHE_FIO_{k.upper()}": v for k, v in env.items()})
    out = subprocess.run(
        ["fio", "--output-format=json", str(HERE / job)], env=e, capture_output=True,
        text=True, check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"fio {job} in {directory} failed:\n{out.stdout}\n{out.stderr}")
    doc = json.loads(out.stdout[out.stdout.index("{"):])
    job0 = doc["jobs"][0]
    kind = "write" if job.startswith("seq-write") else "read"
    side = job0[kind]
    return {
        "mib_s": side["bw_bytes"] / 2**20,
        "iops": side["iops"],
        "bytes": side["io_bytes"],
        "fio_cpu_s": cpu.fio_seconds(job0),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--work", default="/var/tmp/lakecache-fio")
    ap.add_argument("--size", default="512M", help="per seq-read file")
    ap.add_argument("--write-size", default="1G")
    ap.add_argument("--runtime", default="20")
    ap.add_argument("--out", default=str(HERE.parent / "results" / "fio.md"))
    ap.add_argument("--keep-work", action="store_true", help="keep --work after a good run")
    rounds.add_args(ap)
    a = ap.parse_args()
    rounds.check(a.rounds)
    work = Path(a.work)
    if work.exists():
        shutil.rmtree(work)
    (work / "local").mkdir(parents=True)
    c = Cluster(a.bin, work)
    rows: list[tuple[str, str, dict, dict, dict]] = []
    try:
        c.start_worker(fresh=True)
        # Lay the datasets out on both sides (fio writes them).
        for d in (work / "local", c.mnt):
            (d / "small").mkdir(exist_ok=True)
            fio("seq-read.fio", d, size=a.size, jobs="4")
            fio("small-files.fio", d)
        tests = [
            ("seq read 256 KiB, 1 job", "seq-read.fio", {"size": a.size, "jobs": "1"}, "mib_s"),
            ("seq read 256 KiB, 4 jobs", "seq-read.fio", {"size": a.size, "jobs": "4"}, "mib_s"),
            ("rand read 4 KiB, 1 job", "rand-read.fio",
             {"size": a.size, "jobs": "1", "runtime": a.runtime}, "iops"),
            ("rand read 4 KiB, 4 jobs", "rand-read.fio",
             {"size": a.size, "jobs": "4", "runtime": a.runtime}, "iops"),
            ("10,000 x 100 KiB files, read once", "small-files.fio", {}, "mib_s"),
        ]
        for name, job, env, unit in tests:

            def local_once(job=job, env=env) -> dict:
                drop_caches()
                return {"local": cpu.measured(lambda: fio(job, work / "local", **env))}

            def mount_once(job=job, env=env) -> dict:
                c.stop_worker()
                c.start_worker(fresh=True)  # empty worker cache
                drop_caches()
                cold = cpu.measured(lambda: fio(job, c.mnt, **env), c.daemons())
                # Worker cache warm; fio's invalidate=1 drops the kernel's pages.
                warm = cpu.measured(lambda: fio(job, c.mnt, **env), c.daemons())
                return {"cold": cold, "warm": warm}

            got = rounds.interleave(a.rounds, [("local", local_once), ("mount", mount_once)], name)
            rows.append((name, unit, got["local"], got["cold"], got["warm"]))
        # Each round writes a new file: an existing object opened without
        # O_TRUNC is read-only on the mount.
        written = itertools.count()

        def write_once(root: Path, column: str) -> dict:
            d = root / f"write-{next(written)}"
            d.mkdir()
            return {column: cpu.measured(lambda: fio("seq-write.fio", d, size=a.write_size),
                                         c.daemons() if column == "mount" else ())}

        got = rounds.interleave(
            a.rounds,
            [("local", lambda: write_once(work / "local", "local")),
             ("mount", lambda: write_once(c.mnt, "mount"))],
            "seq write",
        )
        rows.append(("seq write 1 MiB + fsync (checkpoint)", "mib_s", got["local"],
                     got["mount"], got["mount"]))
    finally:
        c.close()

    lines = [
        "# fio: lakecache mount vs local disk",
        "",
        *provenance.header(),
        f"Machine: {os.cpu_count()} cores, `uname -r` {os.uname().release}. One s3-server, one "
        "worker and one mount on this machine; job files in benches/fio/. "
        "Local = the same fio job on a local directory of the same disk. Before every "
        "local and cold run the page cache is dropped; cold = a fresh (empty) worker cache; "
        "warm = the run after it (fio's default invalidate=1 drops the kernel's cached pages "
        "of the files, so warm means the worker's cache, not the page cache).",
        "",
        f"Each cell: the median of {a.rounds} interleaved rounds (lowest-highest); a ratio is "
        "the median of the per-round ratios to local disk measured in the same round. "
        "CPU-s/GiB: CPU time (user + system) of fio's jobs and of the lakecache worker and mount "
        "per GiB moved, median over the rounds; the S3 endpoint is left out, as it stands "
        "for the data lake.",
        "",
        "| test | unit | local disk | mount cold | mount warm | cold/local | warm/local |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, unit, local, cold, warm in rows:
        u = "MiB/s" if unit == "mib_s" else "IOPS"
        lines.append(
            f"| {name} | {u} | {rounds.cell(local, unit)} | {rounds.cell(cold, unit)} | "
            f"{rounds.cell(warm, unit)} | {rounds.ratio_cell(cold, local, unit)} | "
            f"{rounds.ratio_cell(warm, local, unit)} |"
        )
    lines.append("")
    lines.append("The write row has one mount column: writes go to S3 through the worker.")
    provenance.write(a.out, lines)
    print(f"wrote {a.out}")
    if not a.keep_work:
        remove_work(work)


if __name__ == "__main__":
    sys.exit(main())
