"""Unit tests of the resume, retention and watchdog logic (no mount)."""

from __future__ import annotations

import hashlib
import io
import json
import time
from contextlib import redirect_stderr
from pathlib import Path

import numpy as np
import pytest
import testproc

from lakecache_trainer import checkpoints, runinfo
from lakecache_trainer.loader import LoaderState, TokenLoader, reshard
from lakecache_trainer.shards import read_header, write_shard
from lakecache_trainer.watchdog import EXIT_STUCK, StepWatchdog


def _shards(tmp_path: Path, n: int, tokens: int = 2000) -> list[str]:
    paths = []
    for i in range(n):
        p = tmp_path / f"s{i:02}.bin"
        write_shard(p, (np.arange(tokens) + i * 7) % 257)
        paths.append(str(p))
    return paths


def _pieces(loader: TokenLoader, state: dict) -> list[tuple[str, int]]:
    """(shard, first token) pieces a loader state still has to read this epoch."""
    pos = LoaderState(**state)
    work = loader.work(pos)[pos.shard :]
    out = []
    for k, (info, first) in enumerate(work):
        out.append((info.path, pos.token if k == 0 and pos.token else first))
    return out


@pytest.mark.parametrize("old_world,new_world", [(2, 1), (2, 3), (4, 2), (3, 5)])
def test_reshard_covers_the_rest_of_the_epoch_once(tmp_path, old_world, new_world):
    paths = _shards(tmp_path, 7)
    old = [TokenLoader(paths, r, old_world, 16, 2, seed=5) for r in range(old_world)]
    # Each old rank read a different amount of its epoch-0 work.
    states = []
    for r, loader in enumerate(old):
        n_work = len(loader.order(0))
        states.append({"epoch": 0, "shard": min(r, n_work - 1), "token": 64 * r, "plan": None})
    remaining = sorted(p for r, lo in enumerate(old) for p in _pieces(lo, states[r]))

    plans = reshard(states, old_world, new_world, len(paths), seed=5)
    assert plans == reshard(states, old_world, new_world, len(paths), seed=5)
    new = [TokenLoader(paths, r, new_world, 16, 2, seed=5) for r in range(new_world)]
    dealt = sorted(p for r, lo in enumerate(new) for p in _pieces(lo, plans[r]))
    assert dealt == remaining  # nothing lost, nothing read twice

    # A second reshard (back to the old size) of the resharded positions
    # again deals out exactly what was left.
    again = reshard(plans, new_world, old_world, len(paths), seed=5)
    back = sorted(p for r, lo in enumerate(old) for p in _pieces(lo, again[r]))
    assert back == remaining


def test_a_resharded_loader_reads_its_plan_then_the_next_epoch(tmp_path):
    paths = _shards(tmp_path, 4, tokens=200)
    states = [{"epoch": 3, "shard": 1, "token": 0, "plan": None} for _ in range(2)]
    plan = reshard(states, 2, 1, len(paths), seed=1)[0]
    loader = TokenLoader(paths, 0, 1, 16, 2, seed=1)
    loader.load_state_dict(plan)
    seen_epochs = set()
    for _ in range(20):  # 2 planned shards (~12 batches), then epoch 4
        next(loader)
        seen_epochs.add(loader.state.epoch)
    loader.close()
    assert seen_epochs == {3, 4}


def test_prune_keeps_the_newest_and_never_latest(tmp_path):
    for s in (2, 4, 6, 8, 10):
        (tmp_path / f"step{s}").mkdir()
    (tmp_path / "other").mkdir()
    assert checkpoints.prune(str(tmp_path), "step8", keep=2) == ["step2", "step4"]
    # step10 is newer than latest (a save in progress): never counted or touched.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "step10", "step6", "step8"]
    assert checkpoints.prune(str(tmp_path), "step8", keep=0) == []


def _manifest(tmp_path: Path, objects: list[dict]) -> Path:
    for o in objects:
        o.setdefault("last_modified_ms", 0)
    doc = {
        "format": "lakecache-snapshot/1",
        "bucket": "data",
        "prefix": "ds/",
        "created_ms": 1,
        "objects": objects,
        "checksum": "",
    }
    doc["checksum"] = hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()
    path = tmp_path / "snap.json"
    path.write_text(json.dumps(doc, indent=2))
    return path


def test_snapshot_manifest_is_checked_and_matched_to_the_shards(tmp_path):
    paths = _shards(tmp_path, 2)
    objs = [
        {"key": f"ds/{Path(p).name}", "size": Path(p).stat().st_size, "etag": "e"} for p in paths
    ]
    snap = runinfo.load_snapshot(str(_manifest(tmp_path, objs)))
    ident = runinfo.dataset_identity([read_header(p) for p in paths], snap)
    assert ident["snapshot_checksum"] == snap["checksum"]

    objs[0]["size"] += 1
    with pytest.raises(SystemExit, match="s00.bin has .* the snapshot records"):
        runinfo.dataset_identity(
            [read_header(p) for p in paths], runinfo.load_snapshot(str(_manifest(tmp_path, objs)))
        )
    path = _manifest(tmp_path, objs)
    path.write_text(path.read_text().replace('"e"', '"f"', 1))
    with pytest.raises(SystemExit, match="checksum mismatch"):
        runinfo.load_snapshot(str(path))


def test_data_difference_names_what_changed():
    a = {"snapshot_checksum": "aa", "shards": [["x.bin", 1], ["y.bin", 2]]}
    b = {"snapshot_checksum": "bb", "shards": [["x.bin", 3], ["z.bin", 2]]}
    diff = runinfo.data_difference(a, b)
    assert diff is not None
    assert "snapshot aa -> bb" in diff
    assert "added: z.bin" in diff and "removed: y.bin" in diff and "changed size: x.bin" in diff
    assert runinfo.data_difference(a, dict(a)) is None


def test_watchdog_fires_once_without_progress_and_not_with_it():
    codes: list[int] = []
    err = io.StringIO()
    with redirect_stderr(err):
        dog = StepWatchdog(0.6, 0, lambda: "/ckpt/step4", exit=codes.append).start()
        for _ in range(8):  # progress every 0.2 s: quiet
            time.sleep(0.2)
            dog.progress("running step 2", 1)
        assert codes == []
        time.sleep(1.5)
        dog.stop()
    assert codes == [EXIT_STUCK]
    text = err.getvalue()
    assert "last good checkpoint: /ckpt/step4" in text
    assert "while running step 2 (last completed step 1)" in text
    assert "stuck-watchdog" in text or "Thread" in text  # the stacks were dumped


def test_a_phase_with_its_own_limit_is_not_cut_by_the_step_limit():
    # Building the engine under load took longer than a short --stuck-timeout
    # (seen: 8 s passed inside deepspeed.initialize's imports on a loaded
    # 2-core machine); that phase is bounded by --build-timeout instead.
    codes: list[int] = []
    err = io.StringIO()
    with redirect_stderr(err):
        dog = StepWatchdog(0.5, 0, lambda: None, exit=codes.append).start()
        dog.progress("building the model and DeepSpeed engine", timeout_s=3600)
        time.sleep(1.5)  # three step limits pass inside the phase: quiet
        assert codes == []
        dog.progress("waiting for the first optimizer step", 0)  # back to 0.5 s
        deadline = time.monotonic() + testproc.scaled(30)
        while not codes and time.monotonic() < deadline:
            time.sleep(0.05)
        dog.stop()
    assert codes == [EXIT_STUCK]
    assert "while waiting for the first optimizer step" in err.getvalue()
