"""`lakecache-train run`: DeepSpeed ZeRO-Offload training over token shards.

Works single-process and under `torchrun`/`deepspeed` launchers (it reads
RANK/WORLD_SIZE/LOCAL_RANK). NCCL on GPUs, gloo on CPU.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from . import manifest
from .loader import TokenLoader
from .model import build_model, flops_per_token
from .shards import list_shards

# Dense bf16 peak by device name, TFLOP/s.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0}


@dataclass
class RunConfig:
    data: str
    checkpoint_dir: str
    model: str = "tiny"
    seq_len: int = 256
    micro_batch: int = 4
    grad_accum: int = 1
    steps: int = 100
    save_every: int = 50
    lr: float = 3e-4
    warmup: int = 10
    seed: int = 1234
    zero_stage: int = 2
    offload_optimizer: bool = True
    offload_param: bool = False
    metrics: str | None = None
    resume: bool = True
    peak_tflops: float | None = None
    log_every: int = 1
    # Test hook: SIGKILL rank 0 after this step (a crash, not a shutdown).
    crash_after_step: int | None = None
    # HMAC key that signs checkpoint manifests (kept off the mount).
    checkpoint_key_file: str | None = None
    allow_unsigned_checkpoints: bool = False


def ds_config(cfg: RunConfig, cuda: bool, world: int) -> dict:
    zero: dict = {"stage": cfg.zero_stage, "contiguous_gradients": True, "overlap_comm": cuda}
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
    if cfg.offload_param:
        if cfg.zero_stage != 3:
            raise SystemExit("--offload-param needs --zero-stage 3")
        zero["offload_param"] = {"device": "cpu", "pin_memory": cuda}
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": cfg.grad_accum,
        "train_batch_size": cfg.micro_batch * cfg.grad_accum * world,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": cuda},
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": cfg.lr, "betas": [0.9, 0.95], "weight_decay": 0.1},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": cfg.lr,
                "warmup_num_steps": cfg.warmup,
            },
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _rng_state() -> dict:
    """Only tensors, ints, floats and tuples: loadable with weights_only=True."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _verified(cfg: RunConfig, tag: str, key: bytes | None, rank: int) -> None:
    """Rank 0 checks the signed manifest before any rank lets DeepSpeed
    unpickle the checkpoint; every rank stops on a refusal."""
    import torch.distributed as dist

    verdict = [None]
    if rank == 0:
        try:
            manifest.verify(cfg.checkpoint_dir, tag, key, cfg.allow_unsigned_checkpoints)
        except manifest.CheckpointRejected as e:
            verdict = [str(e)]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise manifest.CheckpointRejected(verdict[0])


def _peak_tflops(cfg: RunConfig) -> float | None:
    if cfg.peak_tflops:
        return cfg.peak_tflops
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def _write_latest(ckpt_dir: str, tag: str) -> None:
    """The `latest` marker, written after every rank saved: a crash
    mid-save never points at a partial checkpoint."""
    tmp = os.path.join(ckpt_dir, "latest.tmp")
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(ckpt_dir, "latest"))


def run(cfg: RunConfig) -> dict:
    import deepspeed
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    if "RANK" not in os.environ:  # single process without a launcher
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    key = manifest.load_key(cfg.checkpoint_key_file, cfg.checkpoint_dir)
    if key is None and rank == 0 and cfg.save_every > 0:
        print(
            f"warning: no checkpoint key (--checkpoint-key-file or ${manifest.KEY_ENV}): "
            "checkpoints are saved unsigned and will only resume with "
            "--allow-unsigned-checkpoints",
            flush=True,
        )

    random.seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    model = build_model(cfg.model, cfg.seq_len)
    n_params = sum(p.numel() for p in model.parameters())
    loader = TokenLoader(
        list_shards(cfg.data), rank, world, cfg.seq_len, cfg.micro_batch, seed=cfg.seed
    )
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=ds_config(cfg, cuda, world),
    )
    device = engine.device

    step = 0
    latest = Path(cfg.checkpoint_dir) / "latest"
    if cfg.resume and latest.exists():
        tag = latest.read_text().strip()
        _verified(cfg, tag, key, rank)
        _, client = engine.load_checkpoint(cfg.checkpoint_dir, tag)
        if client is None:
            raise SystemExit(f"checkpoint {cfg.checkpoint_dir}/{tag} could not be loaded")
        step = int(client["step"])
        # The trainer's own files never unpickle code.
        tag_dir = Path(cfg.checkpoint_dir) / tag
        loader.load_state_dict(torch.load(tag_dir / f"loader_rank{rank}.pt", weights_only=True))
        _set_rng_state(torch.load(tag_dir / f"rng_rank{rank}.pt", weights_only=True))
        if rank == 0:
            print(f"resumed from {cfg.checkpoint_dir}/{tag} at step {step}", flush=True)

    metrics_file = open(cfg.metrics, "a") if (cfg.metrics and rank == 0) else None  # noqa: SIM115
    cfg_model = model.config
    fpt = flops_per_token(n_params, cfg_model.num_hidden_layers, cfg_model.hidden_size, cfg.seq_len)
    peak = _peak_tflops(cfg)
    tokens_per_step = cfg.micro_batch * cfg.seq_len * cfg.grad_accum * world
    totals = {"steps": 0, "time": 0.0, "wait": 0.0, "stall": 0.0, "tokens": 0}
    losses: list[float] = []
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def save(tag: str) -> float:
        t0 = time.perf_counter()
        engine.save_checkpoint(
            cfg.checkpoint_dir,
            tag=tag,
            client_state={"step": step},
            save_latest=False,
        )
        tag_dir = Path(cfg.checkpoint_dir) / tag
        torch.save(loader.state_dict(), tag_dir / f"loader_rank{rank}.pt")
        torch.save(_rng_state(), tag_dir / f"rng_rank{rank}.pt")
        dist.barrier()
        if rank == 0:
            if key is not None:
                manifest.write(cfg.checkpoint_dir, tag, key)
            _write_latest(cfg.checkpoint_dir, tag)
        dist.barrier()
        return time.perf_counter() - t0

    while step < cfg.steps:
        t0 = time.perf_counter()
        wait = 0.0
        loss_sum = 0.0
        for _ in range(cfg.grad_accum):
            x, y = next(loader)
            wait += loader.wait_seconds
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = engine(input_ids=x).logits
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
            engine.backward(loss)
            engine.step()
            loss_sum += loss.item()
        if cuda:
            torch.cuda.synchronize()
        step += 1
        step_time = time.perf_counter() - t0
        loss_t = torch.tensor([loss_sum / cfg.grad_accum], dtype=torch.float64)
        dist.all_reduce(loss_t)
        mean_loss = loss_t.item() / world
        losses.append(mean_loss)
        stall = 0.0
        if cfg.save_every > 0 and (step % cfg.save_every == 0 or step == cfg.steps):
            stall = save(f"step{step}")
        totals["steps"] += 1
        totals["time"] += step_time
        totals["wait"] += wait
        totals["stall"] += stall
        totals["tokens"] += tokens_per_step
        tok_s = tokens_per_step / step_time
        record = {
            "step": step,
            "loss": mean_loss,
            "tokens_per_s": tok_s,
            "step_time_s": step_time,
            "data_wait_s": wait,
            "data_wait_frac": wait / step_time,
            "checkpoint_stall_s": stall,
            "gpu_mem_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "mfu": (tok_s * fpt / (peak * 1e12)) / world if peak else None,
        }
        if metrics_file and step % cfg.log_every == 0:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
        if cfg.crash_after_step == step and rank == 0:
            print(f"crashing after step {step} (--crash-after-step)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    loader.close()
    elapsed = totals["time"] or 1e-9
    summary = {
        "summary": True,
        "model": cfg.model,
        "params": n_params,
        "world_size": world,
        "steps": totals["steps"],
        "final_step": step,
        "tokens_per_s": totals["tokens"] / elapsed,
        "data_wait_frac": totals["wait"] / elapsed,
        "checkpoint_stall_s": totals["stall"],
        "gpu_mem_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "mfu": ((totals["tokens"] / elapsed) * fpt / (peak * 1e12)) / world if peak else None,
        "zero_stage": cfg.zero_stage,
        "offload_optimizer": cfg.offload_optimizer,
        "offload_param": cfg.offload_param,
        "losses": losses,
    }
    if metrics_file:
        metrics_file.write(json.dumps(summary) + "\n")
        metrics_file.close()
    dist.barrier()
    return summary
