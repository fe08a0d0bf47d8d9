"""`lakecache-train export`: one safetensors file from a ZeRO checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

from . import manifest


def export(
    checkpoint_dir: str,
    out: str,
    tag: str | None = None,
    key_file: str | None = None,
    allow_unsigned: bool = False,
) -> str:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import save_file

    latest = Path(checkpoint_dir) / "latest"
    if tag is None:
        if not latest.exists():
            raise SystemExit(f"{checkpoint_dir}: no 'latest' marker; pass --tag")
        tag = latest.read_text().strip()
    # DeepSpeed unpickles these files: only a signed checkpoint is opened.
    manifest.verify(
        checkpoint_dir, tag, manifest.load_key(key_file, checkpoint_dir), allow_unsigned
    )
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=tag)
    tensors = {k: v.contiguous() for k, v in state.items()}
    tmp = f"{out}.tmp"
    save_file(tensors, tmp, metadata={"source": f"{checkpoint_dir}/{tag}"})
    os.replace(tmp, out)
    return out
