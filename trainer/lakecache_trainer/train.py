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
from lakecache import plans

from . import checkpoints, manifest, runinfo
from .loader import TokenLoader, reshard
from .model import build_model, flops_per_token
from .phases import PhaseClock
from .shards import ShardError, list_shards
from .watchdog import INFLIGHT_ENV, StepWatchdog

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
    # A lakecache snapshot manifest (local path or s3://) the data must match.
    snapshot: str | None = None
    allow_data_change: bool = False
    stuck_timeout: float = 1800.0
    # Building the model and engine: compute, bounded apart from steps.
    build_timeout: float = 1800.0
    # The mount's --metrics-listen address, for its in-flight reads.
    mount_metrics: str | None = None
    # "cache": `latest` moves once the files are durable in the cache;
    # "s3": once `lakecache sync` says they are in S3.
    checkpoint_sync: str = "cache"
    keep_checkpoints: int = 0  # 0: keep all
    # A resume on another world size: weights only, fresh optimizer state.
    reshard_on_resize: bool = False
    # Test hook: "RANK:STEP" makes that rank hang before that step.
    inject_hang: str | None = None


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


def _data_source(cfg: RunConfig) -> tuple[object, str]:
    """(fsspec filesystem, path) for `--data lakecache://...`, pinned to
    the snapshot when one is given in S3; (None, path) for a directory."""
    if not cfg.data.startswith("lakecache://"):
        return None, cfg.data
    from lakecache.dataset import resolve

    in_s3 = cfg.snapshot and cfg.snapshot.startswith(("s3://", "lakecache://"))
    return resolve(cfg.data, cfg.snapshot if in_s3 else None)


def _shard_list(path: str, fs: object, rank: int) -> list[str]:
    """Rank 0 lists the shards and every rank uses its list, so ranks agree
    even when their listings of the mount would differ."""
    import torch.distributed as dist

    box: list = [None]
    if rank == 0:
        try:
            box = [list_shards(path, fs)]
        except ShardError as e:
            box = [e]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], ShardError):
        raise box[0]
    return box[0]


def _resume_loader(
    cfg: RunConfig,
    loader: TokenLoader,
    tag_dir: Path,
    saved: dict | None,
    data_changed: bool,
    world: int,
) -> str:
    """Restores (or reshards) the loader position; returns what was done."""
    rank = loader.rank
    old_world = saved["world_size"] if saved else len(list(tag_dir.glob("loader_rank*.pt")))
    if data_changed:
        # --allow-data-change: the saved positions index another shard list.
        loader.load_state_dict({"epoch": 0, "shard": 0, "token": 0, "plan": None})
        return "the data changed: the loader starts its shard order again"
    if old_world == world:
        loader.load_state_dict(torch.load(tag_dir / f"loader_rank{rank}.pt", weights_only=True))
        return "loader position restored"
    states = [
        torch.load(tag_dir / f"loader_rank{r}.pt", weights_only=True) for r in range(old_world)
    ]
    plans = reshard(states, old_world, world, len(loader.infos), cfg.seed)
    loader.load_state_dict(plans[rank])
    return (
        f"world size {old_world} -> {world}: the rest of epoch {plans[rank]['epoch']} was "
        f"resharded over {world} ranks ({sum(len(p['plan']) for p in plans)} shard pieces)"
    )


def _check_resume(
    cfg: RunConfig, saved: dict | None, current: dict, world: int
) -> tuple[list[str], bool]:
    """Refuses a resume on other data unless allowed; returns notes and
    whether the data changed (allowed)."""
    notes: list[str] = []
    if saved is None:
        return ["the checkpoint records no run identity (written by an older trainer)"], False
    diff = runinfo.data_difference(saved["dataset"], current["dataset"])
    if diff and not cfg.allow_data_change:
        raise runinfo.DataChanged(
            f"refusing to resume: the checkpoint was trained on other data ({diff}). "
            "Resume with --allow-data-change to continue on this data anyway."
        )
    if diff:
        notes.append(f"data changed since the checkpoint (allowed): {diff}")
    changed = runinfo.config_difference(saved, current)
    if changed:
        notes.append("config differs from the checkpoint's: " + ", ".join(changed))
    if saved["world_size"] != world:
        notes.append(
            f"world size {saved['world_size']} -> {world} (--reshard-on-resize): "
            "the optimizer state starts afresh"
        )
    return notes, diff is not None


def run(cfg: RunConfig) -> dict:
    import deepspeed
    import torch.distributed as dist

    if cfg.checkpoint_sync not in ("cache", "s3"):
        raise SystemExit(f"--checkpoint-sync {cfg.checkpoint_sync!r}: expected cache or s3")
    if cfg.keep_checkpoints < 0 or cfg.log_every < 1 or cfg.stuck_timeout <= 0:
        raise SystemExit("--keep-checkpoints must be >= 0, --log-every and --stuck-timeout > 0")
    if cfg.build_timeout <= 0:
        raise SystemExit("--build-timeout must be > 0")
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
    last_good: list[str | None] = [None]
    latest = Path(cfg.checkpoint_dir) / "latest"
    if latest.exists():
        last_good[0] = f"{cfg.checkpoint_dir}/{latest.read_text().strip()}"
    watchdog = StepWatchdog(
        cfg.stuck_timeout,
        rank,
        lambda: last_good[0],
        cfg.mount_metrics or os.environ.get(INFLIGHT_ENV),
    ).start()
    watchdog.progress("listing and opening the dataset shards")
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
    fs, data_path = _data_source(cfg)
    shards = _shard_list(data_path, fs, rank)
    # Read with an unpinned client: the manifest is not inside its snapshot.
    snapshot = runinfo.load_snapshot(cfg.snapshot) if cfg.snapshot else None
    pinned = getattr(getattr(fs, "client", None), "snapshot_checksum", None)
    if snapshot and pinned and pinned != snapshot["checksum"]:
        raise SystemExit(f"the data client is pinned to snapshot {pinned}, not {cfg.snapshot}")
    # Through the cluster, each epoch's read order goes to the workers.
    publish = plans.publisher(fs, f"{plans.job_name()}/{rank}")
    loader = TokenLoader(
        shards, rank, world, cfg.seq_len, cfg.micro_batch, seed=cfg.seed, fs=fs,
        publish_plan=publish,
    )  # fmt: skip
    dataset = runinfo.dataset_identity(loader.infos, snapshot)
    record = runinfo.run_record(cfg, dataset, world)
    watchdog.progress("building the model and DeepSpeed engine", timeout_s=cfg.build_timeout)
    model = build_model(cfg.model, cfg.seq_len)
    n_params = sum(p.numel() for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=ds_config(cfg, cuda, world),
    )
    device = engine.device

    step = 0
    if cfg.resume and latest.exists():
        tag = latest.read_text().strip()
        tag_dir = Path(cfg.checkpoint_dir) / tag
        watchdog.progress(f"loading checkpoint {tag}")
        _verified(cfg, tag, key, rank)
        saved = runinfo.read_run(tag_dir)
        notes, data_changed = _check_resume(cfg, saved, record, world)
        old_world = saved["world_size"] if saved else world
        resize = old_world != world
        if resize and not cfg.reshard_on_resize:
            raise runinfo.DataChanged(
                f"refusing to resume: {tag} was written by {old_world} ranks and this run has "
                f"{world}. DeepSpeed cannot re-partition ZeRO optimizer state for another world "
                f"size. Resume with {old_world} ranks, or pass --reshard-on-resize to load the "
                "weights, start the optimizer state afresh and reshard the rest of the epoch "
                "over the new ranks."
            )
        _, client = engine.load_checkpoint(
            cfg.checkpoint_dir,
            tag,
            load_optimizer_states=not resize,
            load_module_strict=True,
        )
        if client is None:
            raise SystemExit(f"checkpoint {cfg.checkpoint_dir}/{tag} could not be loaded")
        step = int(client["step"])
        # The trainer's own files never unpickle code.
        notes.append(_resume_loader(cfg, loader, tag_dir, saved, data_changed, world))
        rng_file = tag_dir / f"rng_rank{rank}.pt"
        if rng_file.exists():
            _set_rng_state(torch.load(rng_file, weights_only=True))
        if rank == 0:
            print(f"resumed from {cfg.checkpoint_dir}/{tag} at step {step}", flush=True)
            for note in notes:
                print(f"  {note}", flush=True)

    metrics_file = open(cfg.metrics, "a") if (cfg.metrics and rank == 0) else None  # noqa: SIM115
    if metrics_file:
        metrics_file.write(json.dumps({"header": True, "start_step": step, **record}) + "\n")
        metrics_file.flush()
    cfg_model = model.config
    fpt = flops_per_token(n_params, cfg_model.num_hidden_layers, cfg_model.hidden_size, cfg.seq_len)
    peak = _peak_tflops(cfg)
    tokens_per_step = cfg.micro_batch * cfg.seq_len * cfg.grad_accum * world
    totals = {"steps": 0, "time": 0.0, "wait": 0.0, "stall": 0.0, "tokens": 0}
    clock = PhaseClock(cuda)
    losses: list[float] = []
    hang = tuple(int(v) for v in cfg.inject_hang.split(":")) if cfg.inject_hang else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def save(tag: str) -> float:
        t0 = time.perf_counter()
        watchdog.progress(f"saving checkpoint {tag}", step)
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
            runinfo.write_run(tag_dir, record)
            if key is not None:
                manifest.write(cfg.checkpoint_dir, tag, key)
            checkpoints.fsync_tree(tag_dir)
            if cfg.checkpoint_sync == "s3":
                checkpoints.sync_to_s3(tag_dir)
            checkpoints.write_latest(cfg.checkpoint_dir, tag)
            for gone in checkpoints.prune(cfg.checkpoint_dir, tag, cfg.keep_checkpoints):
                print(f"deleted checkpoint {gone} (--keep-checkpoints {cfg.keep_checkpoints})")
        dist.barrier()
        last_good[0] = f"{cfg.checkpoint_dir}/{tag}"
        return time.perf_counter() - t0

    watchdog.progress("waiting for the first optimizer step", step)
    train_start = time.perf_counter()
    while step < cfg.steps:
        if hang and hang[0] == rank and hang[1] == step + 1:
            print(f"rank {rank}: hanging before step {step + 1} (--inject-hang)", flush=True)
            time.sleep(10**6)
        t0 = time.perf_counter()
        clock.begin_step()
        wait = 0.0
        loss_acc = torch.zeros((), device=device, dtype=torch.float32)
        for _ in range(cfg.grad_accum):
            x, y = next(loader)
            wait += loader.wait_seconds
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            clock.start("forward_backward")
            logits = engine(input_ids=x).logits
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
            engine.backward(loss)
            clock.stop()
            clock.start("optimizer")
            engine.step()
            clock.stop()
            loss_acc += loss.detach()  # no host sync per micro-step
        clock.add("data_wait", wait)
        if cuda:
            torch.cuda.synchronize()
        clock.end_step()
        step += 1
        watchdog.progress(f"running step {step + 1}", step)
        step_time = time.perf_counter() - t0
        log_now = step % cfg.log_every == 0 or step == cfg.steps
        mean_loss = None
        if log_now:
            # One all-reduce and one host sync per logged step.
            dist.all_reduce(loss_acc)
            mean_loss = loss_acc.item() / (cfg.grad_accum * world)
            losses.append(mean_loss)
        stall = 0.0
        if cfg.save_every > 0 and (step % cfg.save_every == 0 or step == cfg.steps):
            stall = save(f"step{step}")
            clock.add("checkpoint", stall)
            watchdog.progress(f"running step {step + 1}", step)
        totals["steps"] += 1
        totals["time"] += step_time
        totals["wait"] += wait
        totals["stall"] += stall
        totals["tokens"] += tokens_per_step
        tok_s = tokens_per_step / step_time
        record_step = {
            "step": step,
            "loss": mean_loss,
            "tokens_per_s": tok_s,
            "step_time_s": step_time,
            "data_wait_s": wait,
            "data_wait_frac": wait / step_time,
            "forward_backward_s": clock.step["forward_backward"],
            "optimizer_s": clock.step["optimizer"],
            "checkpoint_stall_s": stall,
            "gpu_mem_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "mfu": (tok_s * fpt / (peak * 1e12)) / world if peak else None,
        }
        if metrics_file and log_now:
            metrics_file.write(json.dumps(record_step) + "\n")
            metrics_file.flush()
        if cfg.crash_after_step == step and rank == 0:
            print(f"crashing after step {step} (--crash-after-step)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    watchdog.stop()
    loader.close()
    wall = time.perf_counter() - train_start
    elapsed = totals["time"] or 1e-9
    breakdown = clock.summary(wall)
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
        "time_breakdown": breakdown,
        "gpu_mem_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "mfu": ((totals["tokens"] / elapsed) * fpt / (peak * 1e12)) / world if peak else None,
        "zero_stage": cfg.zero_stage,
        "offload_optimizer": cfg.offload_optimizer,
        "offload_param": cfg.offload_param,
        "snapshot_checksum": dataset["snapshot_checksum"],
        "losses": losses,
    }
    if rank == 0 and totals["steps"]:
        print(PhaseClock.table(breakdown), flush=True)
    if metrics_file:
        metrics_file.write(json.dumps(summary) + "\n")
        metrics_file.close()
    dist.barrier()
    return summary
