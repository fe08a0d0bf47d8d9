"""CPU tests against a real lakecache mount: `lakecache up` (embedded S3,
a worker, FUSE) started from the binary in $LAKECACHE_BIN."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import testproc
from trainenv import BIN, ENV, KEY_FILE  # noqa: F401

from lakecache_trainer.loader import TokenLoader
from lakecache_trainer.shards import ShardError, read_header, write_shard


def lakecache(*args: str) -> str:
    out = testproc.run("lakecache cli", [BIN, *args], check=True)
    return out.stdout


def train(
    args: list[str],
    data: Path,
    ckpt: Path,
    metrics: Path,
    env: dict | None = None,
    nproc: int = 2,
) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        # torchrun's own rendezvous binds a port of its choosing.
        "--standalone",
        "-m",
        "lakecache_trainer.cli",
        "run",
        "--data",
        str(data),
        "--checkpoint-dir",
        str(ckpt),
        "--metrics",
        str(metrics),
        "--model",
        "tiny",
        "--seq-len",
        "64",
        "--micro-batch",
        "4",
        "--steps",
        "8",
        "--save-every",
        "4",
        "--warmup",
        "2",
        *args,
    ]
    return testproc.run("torchrun train", cmd, env=env or ENV, timeout=900)


def losses(metrics: Path) -> dict[int, float]:
    out = {}
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        if "step" in rec and not rec.get("summary") and not rec.get("header"):
            out[rec["step"]] = rec["loss"]
    return out


def test_interrupted_and_resumed_run_matches_an_uninterrupted_one(mount, tmp_path):
    mnt, worker, token_file = mount
    data = mnt / "datasets" / "tiny"
    prep = testproc.run(
        "prepare",
        [
            sys.executable,
            "-m",
            "lakecache_trainer.cli",
            "prepare",
            "--out",
            str(data),
            "--synthetic",
            "3MiB",
            "--shard-tokens",
            "400000",
        ],
        env=ENV,
    )
    assert prep.returncode == 0, prep.stderr
    assert len(list(data.glob("*.bin"))) >= 4

    ref = train([], data, mnt / "checkpoints" / "ref", tmp_path / "ref.jsonl")
    assert ref.returncode == 0, ref.stderr[-4000:]

    run_dir = mnt / "checkpoints" / "run"
    crashed = train(["--crash-after-step", "6"], data, run_dir, tmp_path / "a.jsonl")
    assert crashed.returncode != 0
    assert (run_dir / "latest").read_text() == "step4"

    resumed = train([], data, run_dir, tmp_path / "b.jsonl")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout
    # Where the time went, printed and in the metrics.
    assert "time breakdown over" in resumed.stdout
    records = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    header, summary = records[0], records[-1]
    assert header["header"] and header["start_step"] == 4 and header["world_size"] == 2
    assert header["shard_order_seed"] == 1234 and header["trainer_version"]
    assert len(header["dataset"]["shard_set_sha256"]) == 64
    breakdown = summary["time_breakdown"]
    assert breakdown["forward_backward_s"] > 0 and breakdown["checkpoint_s"] > 0
    # The run identity is in the checkpoint and covered by its signature.
    saved = json.loads((run_dir / "step8" / "run.json").read_text())
    assert saved["dataset"] == header["dataset"]
    assert "run.json" in (run_dir / "step8" / "manifest.json").read_text()

    want = losses(tmp_path / "ref.jsonl")
    before = losses(tmp_path / "a.jsonl")
    after = losses(tmp_path / "b.jsonl")
    assert sorted(want) == list(range(1, 9))
    assert sorted(after) == [5, 6, 7, 8]
    for step in range(1, 7):
        assert before[step] == pytest.approx(want[step], rel=0, abs=1e-6), step
    for step in range(5, 9):
        assert after[step] == pytest.approx(want[step], rel=0, abs=1e-6), step
    assert want[8] < want[1]  # it learns

    # The checkpoint is in S3 (listed through the worker), `latest` last.
    listing = lakecache(
        "ls",
        "s3://lakecache/checkpoints/run/step8/",
        "--worker",
        worker,
        "--token-file",
        token_file,
    )
    assert "mp_rank_00_model_states.pt" in listing
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in listing
    assert "rng_rank1.pt" in listing
    assert (
        lakecache(
            "cat",
            "s3://lakecache/checkpoints/run/latest",
            "--worker",
            worker,
            "--token-file",
            token_file,
        )
        == "step8"
    )

    out = mnt / "exports" / "model.safetensors"
    out.parent.mkdir(exist_ok=True)
    exp = testproc.run(
        "export",
        [
            sys.executable,
            "-m",
            "lakecache_trainer.cli",
            "export",
            "--checkpoint-dir",
            str(run_dir),
            "--out",
            str(out),
        ],
        env=ENV,
    )
    assert exp.returncode == 0, exp.stderr[-4000:]
    from safetensors.numpy import load_file

    tensors = load_file(str(out))
    assert "model.embed_tokens.weight" in tensors

    # Someone with write access to the bucket but not the key replaces
    # the model states with a pickle that runs code, and re-signs the
    # manifest with a key of their own: the resume refuses before
    # DeepSpeed opens anything.
    marker = tmp_path / "pwned"
    tag_dir = run_dir / "step8"
    (tag_dir / "mp_rank_00_model_states.pt").write_bytes(_evil_pickle(marker))
    doc = json.loads((tag_dir / "manifest.json").read_text())
    from lakecache_trainer import manifest

    other_key = tmp_path / "other-key"
    other_key.write_bytes(b"not-the-cluster-key-0123456789")
    manifest.write(str(run_dir), "step8", other_key.read_bytes())
    assert json.loads((tag_dir / "manifest.json").read_text())["hmac_sha256"] != doc["hmac_sha256"]
    tampered = train(["--steps", "10"], data, run_dir, tmp_path / "c.jsonl")
    assert tampered.returncode != 0
    assert "refusing to load" in tampered.stderr + tampered.stdout
    assert "not signed with this checkpoint key" in tampered.stderr + tampered.stdout
    assert not marker.exists(), "the planted pickle ran"

    # Without the key nothing unsigned or foreign is loaded either.
    no_key = {k: v for k, v in ENV.items() if k != "LAKECACHE_CHECKPOINT_KEY_FILE"}
    refused = train(["--steps", "10"], data, run_dir, tmp_path / "d.jsonl", env=no_key)
    assert refused.returncode != 0
    assert "only signed checkpoints are loaded" in refused.stderr + refused.stdout
    assert not marker.exists()


def test_resume_refuses_other_data_or_world_size_and_keeps_k(mount, tmp_path):
    mnt, worker, token_file = mount
    data = mnt / "datasets" / "resume"
    prep = testproc.run(
        "prepare",
        [sys.executable, "-m", "lakecache_trainer.cli", "prepare", "--out", str(data),
         "--synthetic", "2MiB", "--shard-tokens", "300000"],
        env=ENV,
    )  # fmt: skip
    assert prep.returncode == 0, prep.stderr
    run_dir = mnt / "checkpoints" / "resume"
    # `--checkpoint-sync s3` runs `lakecache sync` against this cluster.
    env = {**ENV, "LAKECACHE_BIN": BIN, "LAKECACHE_WORKER": worker,
           "LAKECACHE_TOKEN_FILE": token_file}  # fmt: skip
    first = train(
        ["--steps", "4", "--save-every", "2", "--keep-checkpoints", "1",
         "--checkpoint-sync", "s3"],
        data, run_dir, tmp_path / "a.jsonl", env=env,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-4000:]
    assert "deleted checkpoint step2 (--keep-checkpoints 1)" in first.stdout
    assert sorted(p.name for p in run_dir.iterdir() if p.is_dir()) == ["step4"]
    listing = lakecache(
        "ls", "s3://lakecache/checkpoints/resume/step4/", "--worker", worker,
        "--token-file", token_file,
    )  # fmt: skip
    assert "run.json" in listing and "loader_rank1.pt" in listing

    # Another shard appears: the resume refuses, naming it.
    extra = data / "zz-extra.bin"
    extra.write_bytes(next(data.glob("*.bin")).read_bytes())
    refused = train(["--steps", "6"], data, run_dir, tmp_path / "b.jsonl")
    out = refused.stdout + refused.stderr
    assert refused.returncode != 0
    assert "refusing to resume: the checkpoint was trained on other data" in out
    assert "1 shard(s) added: zz-extra.bin" in out and "--allow-data-change" in out
    extra.unlink()

    # Fewer ranks: refused, then resharded when asked.
    fewer = train(["--steps", "6"], data, run_dir, tmp_path / "c.jsonl", nproc=1)
    assert fewer.returncode != 0
    assert "written by 2 ranks and this run has 1" in fewer.stdout + fewer.stderr
    resharded = train(
        ["--steps", "6", "--reshard-on-resize"], data, run_dir, tmp_path / "d.jsonl", nproc=1
    )
    assert resharded.returncode == 0, resharded.stderr[-4000:]
    assert "world size 2 -> 1: the rest of epoch 0 was resharded over 1 ranks" in resharded.stdout
    assert (run_dir / "latest").read_text() == "step6"

    # Changed data, allowed.
    extra.write_bytes(next(data.glob("*.bin")).read_bytes())
    allowed = train(
        ["--steps", "8", "--allow-data-change"], data, run_dir, tmp_path / "e.jsonl", nproc=1
    )
    assert allowed.returncode == 0, allowed.stderr[-4000:]
    assert "data changed since the checkpoint (allowed): 1 shard(s) added" in allowed.stdout


def _evil_pickle(marker: Path) -> bytes:
    """A pickle that creates `marker` when unpickled with weights_only=False."""
    import pickle

    class Planted:
        def __reduce__(self):
            return (Path.touch, (marker,))

    return pickle.dumps(Planted())


def test_bad_shards_stop_the_run_naming_the_file(mount, tmp_path):
    mnt, _, _ = mount
    bad = mnt / "datasets" / "bad"
    bad.mkdir(parents=True)
    write_shard(bad / "good.bin", np.arange(5000) % 257)
    (bad / "magic.bin").write_bytes(b"\0" * 2048)
    write_shard(tmp_path / "full.bin", np.arange(5000) % 257)
    (bad / "truncated.bin").write_bytes((tmp_path / "full.bin").read_bytes()[:-100])

    with pytest.raises(ShardError, match="magic.bin: not an llm.c token shard"):
        read_header(bad / "magic.bin")
    with pytest.raises(ShardError, match="truncated.bin: header says 5000 tokens"):
        read_header(bad / "truncated.bin")
    with pytest.raises(ShardError, match="magic.bin"):
        TokenLoader([str(p) for p in sorted(bad.glob("*.bin"))], 0, 1, 16, 2)

    run = testproc.run(
        "train run",
        [
            sys.executable,
            "-m",
            "lakecache_trainer.cli",
            "run",
            "--data",
            str(bad),
            "--checkpoint-dir",
            str(tmp_path / "ck"),
            "--steps",
            "1",
        ],
        # The checkpoint dir is on local disk here, where no key may live.
        env={k: v for k, v in ENV.items() if k != "LAKECACHE_CHECKPOINT_KEY_FILE"},
        timeout=300,
    )
    assert run.returncode == 2
    assert "magic.bin" in run.stderr and "error:" in run.stderr


def test_loader_is_disjoint_deterministic_and_resumable(tmp_path):
    for i in range(4):
        write_shard(tmp_path / f"s{i}.bin", (np.arange(10_000) + i * 10_000) % 60_000)
    shards = sorted(str(p) for p in tmp_path.glob("*.bin"))
    r0 = TokenLoader(shards, 0, 2, 32, 2, seed=7)
    r1 = TokenLoader(shards, 1, 2, 32, 2, seed=7)
    assert {i.path for i in r0.order(0)}.isdisjoint({i.path for i in r1.order(0)})
    assert [i.path for i in r0.order(1)] == [
        i.path for i in TokenLoader(shards, 0, 2, 32, 2, seed=7).order(1)
    ]
    first = [next(r0)[0].clone() for _ in range(5)]
    state = r0.state_dict()
    rest = [next(r0)[0].clone() for _ in range(200)]  # crosses shards and an epoch
    again = TokenLoader(shards, 0, 2, 32, 2, seed=7)
    again.load_state_dict(state)
    replay = [next(again)[0].clone() for _ in range(200)]
    assert all((a == b).all() for a, b in zip(rest, replay, strict=True))
    assert not (first[0] == rest[0]).all()
    x, y = next(again)
    assert (x[:, 1:] == y[:, :-1]).all()
    r0.close(), r1.close(), again.close()
