"""Checkpoint manifests without torch: what verifies and what is refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lakecache_trainer import manifest

KEY = b"k" * 32


def _checkpoint(root: Path) -> Path:
    tag = root / "step4"
    (tag / "sub").mkdir(parents=True)
    (tag / "model.pt").write_bytes(os.urandom(4096))
    (tag / "sub" / "optim.pt").write_bytes(b"optimizer")
    manifest.write(str(root), "step4", KEY)
    return tag


def test_an_untouched_checkpoint_verifies(tmp_path):
    _checkpoint(tmp_path)
    manifest.verify(str(tmp_path), "step4", KEY)


@pytest.mark.parametrize(
    "tamper, message",
    [
        (lambda t: (t / "model.pt").write_bytes(b"changed"), "changed after it was saved"),
        (lambda t: (t / "extra.pt").write_bytes(b"x"), "not in the signed manifest"),
        (lambda t: (t / "sub" / "optim.pt").unlink(), "missing"),
        (lambda t: (t / "manifest.json").unlink(), "has no manifest.json"),
        (lambda t: (t / "manifest.json").write_text("{"), "malformed"),
    ],
)
def test_tampering_is_refused_with_a_clear_message(tmp_path, tamper, message):
    tag = _checkpoint(tmp_path)
    tamper(tag)
    with pytest.raises(manifest.CheckpointRejected, match=message):
        manifest.verify(str(tmp_path), "step4", KEY)


def test_another_key_or_a_moved_tag_is_refused(tmp_path):
    tag = _checkpoint(tmp_path)
    with pytest.raises(manifest.CheckpointRejected, match="not signed with this checkpoint key"):
        manifest.verify(str(tmp_path), "step4", b"x" * 32)
    tag.rename(tmp_path / "step8")
    with pytest.raises(manifest.CheckpointRejected, match="signed for tag 'step4'"):
        manifest.verify(str(tmp_path), "step8", KEY)


def test_no_key_refuses_unless_unsigned_is_allowed(tmp_path):
    _checkpoint(tmp_path)
    with pytest.raises(manifest.CheckpointRejected, match="only signed checkpoints"):
        manifest.verify(str(tmp_path), "step4", None)
    manifest.verify(str(tmp_path), "step4", None, allow_unsigned=True)


def test_a_key_beside_the_checkpoints_is_refused(tmp_path):
    (tmp_path / "ckpt").mkdir()
    key = tmp_path / "key"
    key.write_bytes(KEY)
    with pytest.raises(SystemExit, match="same filesystem"):
        manifest.load_key(str(key), str(tmp_path / "ckpt"))
    short = tmp_path / "short"
    short.write_bytes(b"abc")
    with pytest.raises(SystemExit, match="shorter than 16 bytes"):
        manifest.load_key(str(short), "/nonexistent/ckpt")
