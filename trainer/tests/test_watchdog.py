"""The stuck-step watchdog against injected hangs: a rank that sleeps, and
a read from a lakecache mount that blocks because S3 stopped answering
(the endpoint is SIGSTOPped). Each must end the job with EXIT_STUCK,
stacks, the mount's in-flight reads and the last good checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import testproc
from trainenv import BIN, ENV

from lakecache_trainer.shards import write_shard
from lakecache_trainer.watchdog import EXIT_STUCK

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "wd-test",
    "AWS_SECRET_ACCESS_KEY": "wd-test-secret",
    "AWS_REGION": "us-east-1",
}
# Checkpoints on local disk here: no signing key may live beside them.
LOCAL_ENV = {k: v for k, v in ENV.items() if k != "LAKECACHE_CHECKPOINT_KEY_FILE"}


def _secs(secs: float) -> str:
    """A --stuck-timeout of `secs`, scaled like every test deadline."""
    return f"{max(1, round(testproc.scaled(secs)))}s"


def _run_args(data: Path, ckpt: Path, *extra: str) -> list[str]:
    return [
        "-m", "lakecache_trainer.cli", "run", "--data", str(data),
        "--checkpoint-dir", str(ckpt), "--model", "tiny", "--seq-len", "32",
        "--micro-batch", "2", "--warmup", "1", "--allow-unsigned-checkpoints", *extra,
    ]  # fmt: skip


def test_a_sleeping_rank_ends_the_job_naming_the_last_checkpoint(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(2):
        write_shard(data / f"s{i}.bin", (np.arange(20000) * (i + 3)) % 257)
    ckpt = tmp_path / "ck"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--standalone",
        *_run_args(data, ckpt, "--steps", "8", "--save-every", "2",
                   "--stuck-timeout", _secs(8), "--inject-hang", "1:4"),
    ]  # fmt: skip
    t0 = time.monotonic()
    done = testproc.run("torchrun train", cmd, env=LOCAL_ENV, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "rank 1: hanging before step 4 (--inject-hang)" in out
    reason = [line for line in out.splitlines() if "lakecache-train: stuck:" in line]
    assert reason, out[-4000:]
    print("\n".join(reason))
    assert f"last good checkpoint: {ckpt}/step2" in reason[0]
    assert "last completed step 3" in reason[0]
    assert f"exiting with code {EXIT_STUCK}" in reason[0]
    assert f"exitcode  : {EXIT_STUCK}" in out  # torchrun names the rank's code
    # Both ranks stall at the same moment; the first watchdog to fire ends
    # the job and torchrun stops the other, so either rank may be the one
    # that reports. Its stacks show the training loop, and the sleeping
    # rank's show where it sleeps.
    assert "--- Python stacks of every thread:" in out
    assert 'train.py", line' in out and ", in run" in out
    if any("stuck: rank 1 " in line for line in reason):
        assert "time.sleep(10**6)" in out
    assert time.monotonic() - t0 < testproc.scaled(300)


def test_a_blocked_mount_read_is_named_with_the_mounts_inflight_reads(tmp_path):
    env = {**os.environ, **S3_ENV}
    s3, s3_port = testproc.start_s3_server(
        BIN, tmp_path / "s3", S3_ENV["AWS_ACCESS_KEY_ID"], S3_ENV["AWS_SECRET_ACCESS_KEY"], env
    )
    procs = [s3]
    mnt = tmp_path / "mnt"
    try:
        worker, worker_port = testproc.start_plain_worker(BIN, tmp_path / "cache", s3_port, env)
        procs.append(worker)
        registry = f"static:127.0.0.1:{worker_port}"
        # A read waits on the worker as long as it takes: no S3 fallback,
        # no progress timeout, so only the watchdog can end it.
        mount = testproc.Child(
            "mount",
            [BIN, "mount", "s3://data", str(mnt), "--registry", registry,
             "--metrics-listen", "127.0.0.1:0", "--no-s3-fallback", "--progress-timeout", "1h"],
            env=env,
        )  # fmt: skip
        procs.append(mount)
        metrics_port = mount.wait_for_port("mount metrics at http://", secs=90)

        def mounted() -> bool:
            if mount.proc.poll() is not None:
                raise AssertionError(f"the mount exited\n{mount.describe()}")
            return os.path.ismount(mnt)

        testproc.wait_for("the mount", mounted, secs=90)
        data = mnt / "ds"
        data.mkdir()
        for i in range(2):
            write_shard(data / f"s{i}.bin", (np.arange(20000) * (i + 3)) % 257)
        os.listdir(data)  # the listing is now known to the mount
        freed = testproc.run(
            "lakecache free",
            [BIN, "free", "s3://data/ds/", "--registry", registry],
        )  # fmt: skip
        assert freed.returncode == 0, freed.stderr
        Path("/proc/sys/vm/drop_caches").write_text("3")
        s3.proc.send_signal(signal.SIGSTOP)
        try:
            done = testproc.run(
                "train run",
                [sys.executable, *_run_args(data, tmp_path / "ck", "--steps", "2",
                                            "--stuck-timeout", _secs(6),
                                            "--mount-metrics", f"127.0.0.1:{metrics_port}")],
                env=LOCAL_ENV, timeout=600,
            )  # fmt: skip
        finally:
            s3.proc.send_signal(signal.SIGCONT)
        err = done.stderr
        assert done.returncode == EXIT_STUCK, (done.returncode, err[-4000:])
        reason = [line for line in err.splitlines() if "lakecache-train: stuck:" in line]
        assert reason, err[-4000:]
        print(reason[0])
        assert "while listing and opening the dataset shards" in reason[0]
        assert "last good checkpoint: none" in reason[0]
        inflight = err.split("in-flight operations", 1)[1].split("lakecache-train: stuck:")[0]
        print("in-flight:" + inflight)
        assert '"path": "ds' in inflight, inflight
        assert f'"worker": "127.0.0.1:{worker_port}"' in inflight, inflight
        assert "read_header" in err or "list_shards" in err  # the stacks
    finally:
        for p in reversed(procs):
            p.stop()
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
