"""Snapshots of a versioned bucket: moto's S3 server (a real S3-protocol
HTTP server with object versioning) behind a worker. The snapshot records
VersionIds; after an object is overwritten and another deleted, a mount
and the Python client pinned to the snapshot still read the recorded
versions, through the worker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import boto3
from botocore.config import Config
from helpers import lakecache_bin, start_worker, stop_all, testproc, wait_for

CREDS = {"AWS_ACCESS_KEY_ID": "moto", "AWS_SECRET_ACCESS_KEY": "moto-secret",
         "AWS_REGION": "us-east-1"}  # fmt: skip


def test_a_snapshot_of_a_versioned_bucket_reads_overwritten_and_deleted_objects(tmp_path: Path):
    binary = lakecache_bin()
    env = {**os.environ, **CREDS}
    server = Path(sys.executable).parent / "moto_server"
    # Port 0: werkzeug binds a port of its own and prints it.
    moto = testproc.Child("moto_server", [str(server), "-H", "127.0.0.1", "-p", "0"], env=env)
    procs = [moto]
    mnt = tmp_path / "mnt"
    try:
        moto_port = moto.wait_for_port("Running on http://")
        s3 = boto3.client(
            "s3", endpoint_url=f"http://127.0.0.1:{moto_port}", region_name="us-east-1",
            aws_access_key_id=CREDS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDS["AWS_SECRET_ACCESS_KEY"],
            config=Config(s3={"addressing_style": "path"}),
        )  # fmt: skip
        s3.create_bucket(Bucket="versioned")
        s3.put_bucket_versioning(Bucket="versioned", VersioningConfiguration={"Status": "Enabled"})
        v1 = os.urandom(3 << 20)
        s3.put_object(Bucket="versioned", Key="ds/a.bin", Body=v1)
        s3.put_object(Bucket="versioned", Key="ds/b.bin", Body=b"bee" * 1000)
        worker_proc, worker_port = start_worker(binary, tmp_path / "cache", moto_port, env)
        procs.append(worker_proc)
        worker = f"127.0.0.1:{worker_port}"
        made = subprocess.run(
            [binary, "snapshot", "create", "s3://versioned/ds", "s3://versioned/snaps/s1.json",
             "--worker", worker, "--no-s3-fallback"],
            env=env, capture_output=True, text=True,
        )  # fmt: skip
        assert made.returncode == 0, made.stderr
        print(made.stdout)
        assert "2 objects" in made.stdout and "with S3 version ids" in made.stdout

        # After the snapshot: one object overwritten, one deleted.
        s3.put_object(Bucket="versioned", Key="ds/a.bin", Body=b"new bytes")
        s3.delete_object(Bucket="versioned", Key="ds/b.bin")

        procs.append(
            testproc.Child(
                "mount",
                [
                    binary,
                    "mount",
                    "s3://versioned",
                    str(mnt),
                    "--worker",
                    worker,
                    "--no-s3-fallback",
                    "--snapshot",
                    "s3://versioned/snaps/s1.json",
                ],
                env=env,
            )  # fmt: skip
        )
        wait_for("the mount", lambda: os.path.ismount(mnt))
        assert (mnt / "ds" / "a.bin").read_bytes() == v1
        assert (mnt / "ds" / "b.bin").read_bytes() == b"bee" * 1000

        import lakecache

        client = lakecache.Client(worker=worker, snapshot="s3://versioned/snaps/s1.json")
        size, etag, _ = client.stat("s3://versioned/ds/a.bin")
        assert client.read("s3://versioned/ds/a.bin", 1000, size, etag) == v1[1000:]
    finally:
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
        stop_all(procs)
