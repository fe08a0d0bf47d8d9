"""The FUSE-free Python client (`lakecache` package, PyO3 over the Rust
cluster client) against a real `lakecache up` cluster: fsspec reads,
version pinning, snapshots, the token-shard dataset, and the trainer
reading `--data lakecache://...`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import fsspec
import lakecache
import numpy as np
import pytest
import testproc
import torch
from lakecache.dataset import TokenShardDataset
from lakecache.fsspec_fs import LakecacheFileSystem
from lakecache.loader import TokenLoader
from lakecache.shards import write_shard
from trainenv import BIN, ENV


def cli(worker: str, token_file: str, *args: str) -> subprocess.CompletedProcess:
    return testproc.run(
        "lakecache cli",
        [BIN, *args, "--worker", worker, "--token-file", token_file],
    )


def test_fsspec_lists_reads_and_refuses_clearly(mount):
    mnt, worker, token_file = mount
    d = mnt / "pyclient" / "fs"
    (d / "sub").mkdir(parents=True)
    payload = np.random.default_rng(1).integers(0, 256, 5 << 20, dtype=np.uint8).tobytes()
    (d / "big.bin").write_bytes(payload)
    (d / "sub" / "small.txt").write_bytes(b"hello")

    fs = fsspec.filesystem("lakecache", worker=worker, token_file=token_file)
    names = fs.ls("lakecache://lakecache/pyclient/fs", detail=False)
    assert names == ["lakecache/pyclient/fs/big.bin", "lakecache/pyclient/fs/sub"]
    info = fs.info("lakecache://lakecache/pyclient/fs/big.bin")
    assert info["size"] == len(payload) and info["type"] == "file"
    assert fs.info("lakecache/pyclient/fs/sub")["type"] == "directory"
    with fs.open("lakecache://lakecache/pyclient/fs/big.bin", "rb") as f:
        assert f.read() == payload
        f.seek(3_000_001)
        assert f.read(1000) == payload[3_000_001:3_001_001]
    assert fs.cat_file("lakecache/pyclient/fs/sub/small.txt") == b"hello"
    # One read spanning several concurrently fetched pieces, at odd ends.
    size, etag, _ = fs.client.stat("s3://lakecache/pyclient/fs/big.bin")
    got = fs.client.read("s3://lakecache/pyclient/fs/big.bin", 1000, size - 7, etag)
    assert len(got) == size - 1007 and got == payload[1000:-7]

    with pytest.raises(FileNotFoundError):
        fs.info("lakecache/pyclient/fs/missing.bin")
    with pytest.raises(PermissionError, match="read-only"):
        fs.open("lakecache/pyclient/fs/new.bin", "wb")
    with pytest.raises(ValueError, match="expected s3://bucket/key"):
        fs.client.stat("not-a-uri")
    # A token that is not the cluster's is refused with the worker's reason.
    bad = mnt.parent / "bad-token"
    bad.write_text("lc1.not-a-real-token")
    other = lakecache.Client(worker=worker, token_file=str(bad))
    with pytest.raises(PermissionError):
        other.stat("s3://lakecache/pyclient/fs/big.bin")

    # Changed while open: the open file is pinned to its ETag.
    f = fs.open("lakecache/pyclient/fs/sub/small.txt", "rb", cache_type="none")
    (d / "sub" / "small.txt").write_bytes(b"HELLO, changed")
    with pytest.raises(lakecache.ObjectChangedError):
        f.read()
    assert fs.cat_file("lakecache/pyclient/fs/sub/small.txt") == b"HELLO, changed"


def test_a_published_plan_reaches_the_workers_and_a_malformed_one_is_refused(mount):
    """Issue #35's first part: a rank's read order goes to the workers,
    which evict by it; missing objects are skipped, bad plans refused."""
    mnt, worker, token_file = mount
    d = mnt / "pyclient" / "plan"
    d.mkdir(parents=True)
    for i in range(3):
        (d / f"{i}.bin").write_bytes(bytes([i]) * (3 << 20))
    client = lakecache.Client(worker=worker, token_file=token_file)
    base = "s3://lakecache/pyclient/plan"
    order = [(f"{base}/{i}.bin", 0, 3 << 20) for i in (2, 0, 1)]
    got = client.publish_plan("train/0", [*order, (f"{base}/gone.bin", 0, 10)], ttl_s=60)
    assert got["workers"] == 1 and got["pages"] >= 3, got
    assert got["skipped_entries"] == 1 and "gone.bin" in got["skipped"][0], got
    with pytest.raises(ValueError, match="overlap"):
        client.publish_plan("train/0", [(f"{base}/0.bin", 0, 10), (f"{base}/0.bin", 5, 20)])
    with pytest.raises(ValueError, match="empty or reversed"):
        client.publish_plan("train/0", [(f"{base}/0.bin", 7, 7)])
    with pytest.raises(ValueError, match="JOB/RANK"):
        client.publish_plan("train", order)
    with pytest.raises(ValueError, match="ttl_s"):
        client.publish_plan("train/0", order, ttl_s=0)
    with pytest.raises(ValueError, match="plan entry 0"):
        client.publish_plan("train/0", [("not-a-uri", 0, 1)])
    # The cache serves on.
    size, etag, _ = client.stat(f"{base}/1.bin")
    assert client.read(f"{base}/1.bin", 0, size, etag) == bytes([1]) * (3 << 20)


def test_with_no_worker_answering_reads_go_to_s3_only_when_allowed(mount):
    mnt, _, token_file = mount
    d = mnt / "pyclient" / "fallback"
    d.mkdir(parents=True)
    (d / "x.bin").write_bytes(b"x" * 3000)
    endpoint = (mnt.parent / "s3-endpoint").read_text().strip()
    creds = dict(
        line.split("=", 1) for line in (mnt.parent / "data" / "s3-credentials").read_text().split()
    )
    dead = "127.0.0.1:1"  # tcpmux: nothing listens there, connections are refused
    cut_off = lakecache.Client(worker=dead, token_file=token_file, progress_timeout_s=0.5)
    with pytest.raises(OSError, match=dead):
        cut_off.stat("s3://lakecache/pyclient/fallback/x.bin")
    old = {k: os.environ.get(k) for k in creds}
    os.environ.update(creds)  # the standard AWS chain, as for the mount
    try:
        direct = lakecache.Client(
            worker=dead, token_file=token_file, progress_timeout_s=0.5, s3_fallback=True,
            s3_endpoint=endpoint, s3_path_style=True,
        )  # fmt: skip
        size, etag, _ = direct.stat("s3://lakecache/pyclient/fallback/x.bin")
        assert direct.read("s3://lakecache/pyclient/fallback/x.bin", 0, size, etag) == b"x" * 3000
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _fetched_from_workers(worker: str) -> int:
    """Object bytes the worker has sent to readers: over HTTP or inline on
    its local socket, plus those it granted as page-file descriptors."""
    text = urllib.request.urlopen(f"http://{worker}/metrics", timeout=30).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("lakecache_served_bytes_total", "lakecache_local_served_bytes_total"):
            values[name] = float(value)
    assert len(values) == 2, f"the worker exports only {sorted(values)}:\n{text}"
    return int(sum(values.values()))


def _whole_in_tier(tier: Path, key: str) -> bool:
    """The tier's metadata (each object's .meta, JSON) shows every block
    of `key` filled."""
    for meta in tier.glob("*.meta"):
        m = json.loads(meta.read_text())["meta"]
        if m["uri"].endswith("/" + key) and all(c is not None for c in m["crcs"]):
            return True
    return False


def test_the_python_client_reads_through_the_mounts_tier_so_an_object_is_fetched_once(mount):
    """Issue #35's fourth part: a Client given the mount's --local-cache
    reads through the mount's node-local tier, so an object read by both
    paths is fetched from the workers once, whichever reads first."""
    mnt, worker, token_file = mount
    tier = mnt.parent / "data" / "local-cache"
    base = "pyclient/tier"
    rng = np.random.default_rng(35)
    sizes = {"w": 1 << 20, "a": (6 << 20) + 123, "b": (5 << 20) + 7}
    payload = {n: rng.integers(0, 256, size, dtype=np.uint8).tobytes() for n, size in sizes.items()}
    for n, data in payload.items():
        # One directory each: an open prefetches its directory's files.
        (mnt / base / n).mkdir(parents=True)
        (mnt / base / n / "x.bin").write_bytes(data)
    uri = {n: f"s3://lakecache/{base}/{n}/x.bin" for n in payload}
    plain = lakecache.Client(worker=worker, token_file=token_file)
    # Both counters exist once the worker has served each way.
    assert (mnt / base / "w" / "x.bin").read_bytes() == payload["w"]
    size, etag, _ = plain.stat(uri["w"])
    assert plain.read(uri["w"], 0, size, etag) == payload["w"]

    shared = lakecache.Client(worker=worker, token_file=token_file, local_cache=str(tier))
    # The client reads first: the mount fetches, fills its tier, and the
    # mount's own read then finds the object there.
    before = _fetched_from_workers(worker)
    size, etag, _ = shared.stat(uri["a"])
    assert shared.read(uri["a"], 0, size, etag) == payload["a"]
    assert shared.tier_stats()["inline_bytes"] == size, shared.tier_stats()
    testproc.wait_for("a.bin whole in the tier", lambda: _whole_in_tier(tier, f"{base}/a/x.bin"))
    assert (mnt / base / "a" / "x.bin").read_bytes() == payload["a"]
    # Read again, the client is handed the tier's file and reads it itself.
    assert shared.read(uri["a"], 1000, size - 3, etag) == payload["a"][1000:-3]
    assert shared.tier_stats()["file_bytes"] == size - 1003, shared.tier_stats()
    assert _fetched_from_workers(worker) - before == len(payload["a"])

    # The mount reads first; the client then reads the tier's file.
    before = _fetched_from_workers(worker)
    assert (mnt / base / "b" / "x.bin").read_bytes() == payload["b"]
    testproc.wait_for("b.bin whole in the tier", lambda: _whole_in_tier(tier, f"{base}/b/x.bin"))
    size_b, etag_b, _ = shared.stat(uri["b"])
    assert shared.read(uri["b"], 0, size_b, etag_b) == payload["b"]
    stats = shared.tier_stats()
    assert stats["file_bytes"] == size - 1003 + size_b and stats["unavailable"] == 0, stats
    assert _fetched_from_workers(worker) - before == len(payload["b"])

    # The control: a client without the tier fetches the object again.
    before = _fetched_from_workers(worker)
    assert plain.read(uri["b"], 0, size_b, etag_b) == payload["b"]
    assert _fetched_from_workers(worker) - before == len(payload["b"])

    # A plan goes to the workers and to the mount's tier, which fetches
    # ahead of it (tests in fuse-client/tests/tier_socket.rs).
    got = shared.publish_plan("tiertest/0", [(uri["b"], 0, size_b), (uri["a"], 0, size)], ttl_s=60)
    assert got["tier_entries"] == 2 and got["workers"] == 1, got
    # Errors come back as the workers would give them.
    with pytest.raises(ValueError, match="outside"):
        shared.read(uri["b"], 0, size_b + 1, etag_b)
    with pytest.raises(lakecache.ObjectChangedError):
        shared.read(uri["a"], 0, 10, "not-its-etag")
    with pytest.raises(FileNotFoundError):
        shared.read(f"s3://lakecache/{base}/none.bin", 0, 10, etag)
    # A directory no mount serves is named, with what to do.
    with pytest.raises(OSError, match="is a lakecache mount with --local-cache"):
        lakecache.Client(worker=worker, token_file=token_file, local_cache=str(mnt.parent))


def test_a_snapshot_client_serves_recorded_versions_and_names_a_changed_one(mount):
    mnt, worker, token_file = mount
    d = mnt / "pyclient" / "snap"
    d.mkdir(parents=True)
    (d / "a.bin").write_bytes(b"a" * 1000)
    (d / "b.bin").write_bytes(b"b" * 1000)
    made = cli(worker, token_file, "snapshot", "create", "s3://lakecache/pyclient/snap",
               "s3://lakecache/pyclient-snapshots/snap-1.json")  # fmt: skip
    assert made.returncode == 0, made.stderr
    (d / "b.bin").write_bytes(b"B" * 1000)  # changed after the snapshot
    (d / "c.bin").write_bytes(b"c")  # added after it

    client = lakecache.Client(
        worker=worker,
        token_file=token_file,
        snapshot="s3://lakecache/pyclient-snapshots/snap-1.json",
    )
    assert client.snapshot_checksum and len(client.snapshot_checksum) == 64
    objects, _ = client.list("s3://lakecache/pyclient/snap/")
    # (The mount's mkdir left a directory marker, which the snapshot keeps.)
    files = [k for k, _, _ in objects if not k.endswith("/")]
    assert files == ["pyclient/snap/a.bin", "pyclient/snap/b.bin"]
    size, etag, _ = client.stat("s3://lakecache/pyclient/snap/a.bin")
    assert client.read("s3://lakecache/pyclient/snap/a.bin", 0, size, etag) == b"a" * 1000
    with pytest.raises(FileNotFoundError):
        client.stat("s3://lakecache/pyclient/snap/c.bin")
    size, etag, _ = client.stat("s3://lakecache/pyclient/snap/b.bin")
    with pytest.raises(lakecache.SnapshotMismatchError) as err:
        client.read("s3://lakecache/pyclient/snap/b.bin", 0, size, etag)
    print(err.value)
    assert "changed since the snapshot" in str(err.value)
    assert f"pins ETag {etag}" in str(err.value)


class _RefusesPlans:
    """A client whose plan publishing fails, as with no worker answering."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def publish_plan(self, *args, **kwargs):
        raise OSError("worker gone")


def _batches(source, n: int) -> list[torch.Tensor]:
    return [next(source)[0].clone() for _ in range(n)]


def test_dataset_matches_the_trainers_loader_and_the_trainer_reads_lakecache_uris(mount, tmp_path):
    mnt, worker, token_file = mount
    d = mnt / "pyclient" / "tokens"
    d.mkdir(parents=True)
    for i in range(4):
        write_shard(d / f"shard{i}.bin", (np.arange(30_000) * (i + 1)) % 257)
    uri = "lakecache://lakecache/pyclient/tokens"
    client = {"worker": worker, "token_file": token_file}

    # The same batches as the loader reading the mounted directory.
    local = TokenLoader(sorted(str(p) for p in d.glob("*.bin")), 1, 2, 32, 4, seed=7)
    want = _batches(local, 30)
    local.close()
    ds = TokenShardDataset(uri, seq_len=32, micro_batch=4, seed=7, rank=1, world_size=2, **client)
    it = iter(ds)
    got = _batches(it, 30)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # Resumable: a new dataset from the state continues where this one is.
    state = ds.state_dict()
    following = next(it)[0]
    ds2 = TokenShardDataset(uri, seq_len=32, micro_batch=4, seed=7, rank=1, world_size=2, **client)
    ds2.load_state_dict(state)
    assert torch.equal(next(iter(ds2))[0], following)
    # Through the cluster, the epoch's read order went to the worker as
    # a plan: the rest of this rank's two shards, header left out.
    assert ds.plan_result is not None and ds.plan_result["pages"] >= 1, ds.plan_result
    assert ds.plan_result["skipped_entries"] == 0, ds.plan_result
    # A plan the workers cannot take is a warning; training reads on.
    fs = LakecacheFileSystem(skip_instance_cache=True, **client)
    fs.client = _RefusesPlans(fs.client)
    ds3 = TokenShardDataset(
        "lakecache/pyclient/tokens", seq_len=32, micro_batch=4, seed=7, rank=1, world_size=2, fs=fs
    )
    with pytest.warns(UserWarning, match="publishing read plan dataset/1 failed: worker gone"):
        assert torch.equal(next(iter(ds3))[0], want[0])
    # Rank 0 reads other shards.
    ds0 = TokenShardDataset(uri, seq_len=32, micro_batch=4, seed=7, rank=0, world_size=2, **client)
    assert not torch.equal(next(iter(ds0))[0], want[0])

    # The trainer on `--data lakecache://...`, pinned to a snapshot in S3.
    made = cli(worker, token_file, "snapshot", "create", "s3://lakecache/pyclient/tokens",
               "s3://lakecache/pyclient-snapshots/tokens.json")  # fmt: skip
    assert made.returncode == 0, made.stderr
    env = {k: v for k, v in ENV.items() if k != "LAKECACHE_CHECKPOINT_KEY_FILE"}
    env.update(LAKECACHE_WORKER=worker, LAKECACHE_TOKEN_FILE=token_file)
    metrics = tmp_path / "m.jsonl"
    run = testproc.run(
        "train run",
        [sys.executable, "-m", "lakecache_trainer.cli", "run", "--data", uri,
         "--snapshot", "s3://lakecache/pyclient-snapshots/tokens.json",
         "--checkpoint-dir", str(tmp_path / "ck"), "--model", "tiny", "--seq-len", "32",
         "--micro-batch", "2", "--steps", "3", "--save-every", "0", "--metrics", str(metrics)],
        env=env, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    header = json.loads(metrics.read_text().splitlines()[0])
    snap = json.loads(
        testproc.run(
            "lakecache cat",
            [BIN, "cat", "s3://lakecache/pyclient-snapshots/tokens.json", "--worker", worker,
             "--token-file", token_file],
            check=True,
        ).stdout
    )  # fmt: skip
    assert header["dataset"]["snapshot_checksum"] == snap["checksum"]
    assert [name for name, _ in header["dataset"]["shards"]] == [f"shard{i}.bin" for i in range(4)]


def test_a_map_style_dataset_with_a_planned_sampler_reads_every_record_in_loader_workers(mount):
    """Issue #35, map-style: a sampler's epoch order goes to the workers as
    a plan before the epoch, and DataLoader workers (spawned, each with its
    own client) read every record right."""
    from lakecache.samples import PlannedSampler, RecordDataset, records_to_tensor

    mnt, worker, token_file = mount
    d = mnt / "pyclient" / "records"
    d.mkdir(parents=True)
    record = 64 << 10
    for i in range(3):
        # 16 bytes of header, then records whose bytes say (object, record).
        body = b"H" * 16 + b"".join(bytes([i * 10 + r]) * record for r in range(6))
        (d / f"{i}.bin").write_bytes(body + b"tail")
    uris = [f"s3://lakecache/pyclient/records/{i}.bin" for i in range(3)]
    ds = RecordDataset(
        uris,
        record,
        header_bytes=16,
        transform=records_to_tensor,
        worker=worker,
        token_file=token_file,
    )
    assert len(ds) == 18
    assert ds.sample_range(7) == (uris[1], 16 + record, 16 + 2 * record)
    with pytest.raises(IndexError):
        ds.sample_range(18)
    inner = torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(3))
    sampler = PlannedSampler(inner, ds, job="records", rank=0, ttl_s=60)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=4, sampler=sampler, num_workers=2, multiprocessing_context="spawn"
    )
    seen = []
    for batch in loader:
        assert batch.shape[1] == record
        seen += [int(row[0]) for row in batch]
        assert all(bool((row == row[0]).all()) for row in batch)
    assert sorted(seen) == sorted(i * 10 + r for i in range(3) for r in range(6))
    assert sampler.name == "records/0"
    result = sampler.plan_result
    assert result is not None and result["pages"] >= 3 and result["skipped_entries"] == 0, result

    # A plan the workers refuse is a warning; the epoch reads the same.
    class Refusing:
        def __init__(self, real):
            self.real = real

        def publish_plan(self, *args, **kwargs):
            raise OSError("worker gone")

    ds.client()  # this process's client, wrapped below
    real = ds._client
    ds._client = Refusing(real)
    ds._pid = os.getpid()
    order = [5, 1, 17, 0]
    with pytest.warns(UserWarning, match="publishing read plan records/0 failed: worker gone"):
        drawn = list(PlannedSampler(_Fixed(order), ds, job="records", rank=0))
    assert drawn == order
    ds._client = real


def test_a_planned_sampler_plans_the_next_epoch_where_the_epoch_decides_the_order():
    """A DistributedSampler's order follows from its epoch: the plan runs on
    into the next epoch, and the sampler stays at its own epoch. A plan the
    workers find too long goes out for this epoch alone."""
    from lakecache.samples import PlannedSampler

    class Ranges:
        def __len__(self):
            return 10

        def sample_range(self, i):
            return ("s3://b/k", i * 10, i * 10 + 10)

        def client(self):
            return self.published

    class Capturing:
        def __init__(self, limit=None):
            self.plans, self.limit = [], limit

        def publish_plan(self, name, entries, ttl_s):
            if self.limit is not None and len(entries) > self.limit:
                raise ValueError(f"more than {self.limit} entries")
            self.plans.append([start // 10 for _, start, _ in entries])
            return {"pages": len(entries), "skipped_entries": 0}

    ds = Ranges()
    inner = torch.utils.data.DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=7)
    inner.set_epoch(3)
    epoch3, epoch4 = list(inner), None
    inner.set_epoch(4)
    epoch4 = list(inner)
    inner.set_epoch(3)
    assert epoch3 != epoch4

    ds.published = Capturing()
    sampler = PlannedSampler(inner, ds, job="j", rank=0)
    assert list(sampler) == epoch3
    assert ds.published.plans == [epoch3 + epoch4]
    assert list(inner) == epoch3, "the sampler is left at its own epoch"

    ds.published = Capturing(limit=10)
    assert list(PlannedSampler(inner, ds, job="j", rank=0)) == epoch3
    assert ds.published.plans == [epoch3]

    ds.published = Capturing()
    assert list(PlannedSampler(inner, ds, job="j", rank=0, plan_next_epoch=False)) == epoch3
    assert ds.published.plans == [epoch3]


class _Fixed(torch.utils.data.Sampler):
    def __init__(self, order: list[int]) -> None:
        self.order = order

    def __iter__(self):
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)
