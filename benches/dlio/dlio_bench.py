#!/usr/bin/env python3
"""MLPerf Storage's DLIO benchmark through lakecache, local disk and s3fs
(issue #34); writes benches/results/dlio.md and dlio-au.png.

Run by `benches/dlio/run.sh` (which builds the binaries and installs DLIO)
with the DLIO venv's python:

    dlio_bench.py --bin target/release/lakecache --proxy target/release/delay-proxy [--quick]

For each workload, the dataset is generated once on local disk and once
into the bucket through a mount (write-through). Each reader then trains
on it under a memory cgroup that caps the page cache, with the lakecache
daemons (or s3fs) under a cap of their own, so warm figures describe the
storage, not RAM. Every run starts cold (caches emptied, page cache
dropped): epoch 1 is the cold figure, the later epochs the warm one. The
S3 endpoint sits behind the delay proxy at each RTT.

These are scaled runs on one small machine, not MLPerf Storage
submissions: the datasets are far smaller than MLPerf's rules ask, and the
emulated compute time is scaled (the factor is printed) so that local disk
reaches about 90% AU with one accelerator here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "fio"))

import cpu  # noqa: E402
import summary  # noqa: E402
from cgroup import AnonPeak, BenchError, Cgroup, ReadCounter  # noqa: E402
from lake import DAEMONS_MEMORY, Lake  # noqa: E402
from local_tier import install_s3fs  # noqa: E402
from page_reporting import SAVED as SAVED_REPORTING  # noqa: E402
from page_reporting import PageReporting  # noqa: E402
from run import (  # noqa: E402
    BUCKET,
    drop_caches,
    mounted,
    remove_work,
)

GIB = 1 << 30
# The readers' cgroup limit while their own memory is measured (the
# first calibration run): enough for a DLIO UNet3D process with DLIO's
# batch of 7 (a 1.53 GiB peak of anonymous memory was seen).
PROCESS_MEMORY = int(1.75 * GIB)


@dataclass(frozen=True)
class Workload:
    name: str
    config: str  # DLIO's workload config
    files: int
    files_quick: int
    batch: int  # samples per step here
    dlio_batch: int  # and in DLIO's config
    compute_s: float  # DLIO's emulated compute per step (its batch) for an H100
    samples_per_file: int
    mean_file_bytes: int  # for the free-space check
    overrides: tuple[str, ...] = ()

    def per_sample_factor(self, compute_s: float) -> float:
        """The emulated compute per sample here over DLIO's H100 figure."""
        return (compute_s / self.batch) / (self.compute_s / self.dlio_batch)


# UNet3D's real files and samples (about 146 MB each), in steps of 2
# samples instead of 7: the few files this disk holds still make several
# steps per accelerator (DLIO leaves the first step out of AU).
UNET3D = Workload("unet3d", "unet3d_h100", 24, 14, 2, 7, 0.323, 1, 147 * 10**6)
# DLIO's ResNet-50 reads TFRecords with TensorFlow's loader.
RESNET50 = Workload("resnet50", "resnet50_h100", 8, 4, 400, 400, 0.224, 1251, 144 * 10**6)
WORKLOADS = {w.name: w for w in (UNET3D, RESNET50)}
# megatron_deepspeed's checkpoints, model scaled down about 10x (one
# checkpoint of the real config writes about 18 GB): per checkpoint one
# optimizer file of about 375 MB, four layer files of 15 MB and the model.
MEGATRON_SCALED = (
    "++workload.checkpoint.optimization_groups=[100925440,86507520,79360]",
    "++workload.checkpoint.num_layers=4",
    "++workload.checkpoint.layer_parameters=[12976128,2097152]",
    "++workload.checkpoint.steps_between_checkpoints=2",
    "++workload.dataset.num_files_train=1",
    "++workload.dataset.num_samples_per_file=8192",
    "++workload.reader.batch_size=1024",
    "++workload.train.epochs=1",
)
MEGATRON = Workload(
    "megatron_deepspeed",
    "megatron_deepspeed",
    1,
    1,
    1024,
    1024,
    0.03,
    8192,
    17 * 10**6,
    MEGATRON_SCALED,
)
CHECKPOINT_MEMORY = 4 * GIB
CHECKPOINT_TARGETS = ("local", "local-fsync", "mount-back", "mount-through")
# `local-fsync`: local disk with each checkpoint file fsynced before it is
# closed (DLIO's save patched by durable_local/sitecustomize.py): what
# durability costs on this disk, as write-back's close waits for it.
DURABLE_LOCAL = Path(__file__).resolve().parent / "durable_local"
# What one checkpoint run writes (4 checkpoints of the scaled model, about
# 2.3 GiB), with room: it is held on local disk, or in the bucket, the
# worker's cache and its write-back staging at once, and removed after.
CHECKPOINT_RUN_BYTES = int(2.5 * GIB)
# mount-tier-whole: the tier with the dataset directory fetched whole on
# open (`--local-cache-whole dlio/`), as a training mount would set it.
# pyclient-tier: the Python client reading through the mount's tier (its
# socket, `local_cache=`); pyclient reads from the workers alone.
READERS = (
    "local",
    "mount-workers",
    "mount-tier",
    "mount-tier-whole",
    "pyclient",
    "pyclient-tier",
    "s3fs",
)
# `--quick`: one figure for each of issue #34's targets (warm AU through
# the tier against local disk, cold at 10 ms against s3fs) and no more:
# a DLIO run costs about 20 s of start-up (TensorFlow, torch, MPI) before
# its first epoch, so the number of runs is the quick form's length.
QUICK_READERS = ("local", "mount-tier", "s3fs")
QUICK_RTT_MS = 10
# The compute search: runs with no compute (the fastest is kept) and runs
# halving the interval around 90% AU, in the full form and in --quick.
CALIBRATION_RUNS = {False: (2, 5), True: (1, 2)}
# `--quick` leaves write-through out of its checkpoint round (its runs
# are the longest, and no target names it).
QUICK_CHECKPOINT_TARGETS = ("local", "mount-back")


def dlio(
    a: argparse.Namespace,
    w: Workload,
    data: Path,
    out: Path,
    np_: int,
    reader_cg: Cgroup,
    extra: list[str],
    env: dict[str, str] | None = None,
    counter: ReadCounter | AnonPeak | None = None,
) -> None:
    """One DLIO run; a failure names its log."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    args = [
        *reader_cg.prefix(),
        a.mpirun,
        "-np",
        str(np_),
        str(dlio_entry()),
        f"workload={w.config}",
        f"++workload.dataset.data_folder={data}",
        f"++workload.output.folder={out}",
        f"hydra.run.dir={out}",
        *w.overrides,
        *extra,
    ]
    log = out / "run.log"
    started = time.monotonic()
    with open(log, "w") as f:
        p = subprocess.Popen(
            args,
            stdout=f,
            stderr=subprocess.STDOUT,
            # DLIO runs tools from its venv (tfrecord2idx).
            env={
                **os.environ,
                "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
                **(env or {}),
            },
            cwd=out,
        )
        while p.poll() is None:
            if counter:
                counter.poll()
            time.sleep(0.25)
    # Where a run's time goes (a DLIO start alone is about 20 s here).
    print(f"  DLIO {out.name}: {time.monotonic() - started:.0f} s", flush=True)
    if p.returncode != 0:
        raise BenchError(f"DLIO failed (exit {p.returncode}); its log: {log}")


def pyclient_bytes(counts: Path) -> int:
    """What the reader plugin's processes read (see lakecache_reader.py)."""
    return sum(int(p.read_text() or 0) for p in counts.iterdir()) if counts.is_dir() else 0


def generated(data: Path, files: int) -> bool:
    """The dataset is all there (a generation that failed midway is
    started over: DLIO refuses to train on fewer files)."""
    train = data / "train"
    if train.is_dir() and len(list(train.iterdir())) >= files:
        return True
    if data.exists():
        shutil.rmtree(data)
    return False


def generate(a, w: Workload, data: Path, reader_cg: Cgroup) -> None:
    dlio(
        a,
        w,
        data,
        a.work / "out" / f"gen-{w.name}-{data.parent.name}",
        1,
        reader_cg,
        [
            "++workload.workflow.generate_data=True",
            "++workload.workflow.train=False",
            "++workload.workflow.checkpoint=False",
            f"++workload.dataset.num_files_train={a.files[w.name]}",
        ],
    )


def batch_of(a, w: Workload) -> int:
    """Samples per step (the smoke run's handful of files make no batch
    of the workload's size)."""
    return 1 if a.smoke else w.batch


def train_flags(a, w: Workload, compute_s: float, epochs: int) -> list[str]:
    return [
        f"++workload.reader.batch_size={batch_of(a, w)}",
        "++workload.workflow.generate_data=False",
        "++workload.workflow.train=True",
        "++workload.workflow.checkpoint=False",
        f"++workload.dataset.num_files_train={a.files[w.name]}",
        f"++workload.train.epochs={epochs}",
        f"++workload.train.computation_time={compute_s}",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--bin", required=True, help="the release lakecache binary")
    ap.add_argument("--proxy", help="the delay-proxy binary (needed for --rtt-ms other than 0)")
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/lakecache-dlio"))
    ap.add_argument("--out", type=Path, default=HERE.parent / "results" / "dlio.md")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="UNet3D only, fewer files, one accelerator; unless named, the readers "
        f"{','.join(QUICK_READERS)} at {QUICK_RTT_MS} ms (local disk at 0 ms), a shorter "
        "compute search and one checkpoint round (under 10 min)",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest configuration through a mount: the opt-in test",
    )
    ap.add_argument(
        "--workloads",
        default="unet3d,resnet50",
        help="training workloads to run, or none for the checkpoints alone",
    )
    ap.add_argument("--readers", help=f"default: {','.join(READERS)}")
    ap.add_argument("--rtt-ms", help="default: 0,10")
    ap.add_argument("--max-accelerators", type=int, default=4)
    ap.add_argument(
        "--epochs",
        type=int,
        default=8,
        help="epochs per run: the first is cold, the mean of the rest warm (an epoch here is "
        "a few seconds, and one 0.2 s stall in it moves its AU by 30 points)",
    )
    ap.add_argument(
        "--no-checkpoints", action="store_true", help="skip the megatron_deepspeed checkpoints"
    )
    ap.add_argument("--checkpoint-rounds", type=int, default=3)
    ap.add_argument(
        "--checkpoint-targets",
        help="where the checkpoints go, of " + ", ".join(CHECKPOINT_TARGETS) + " (default: all; "
        f"{','.join(QUICK_CHECKPOINT_TARGETS)} with --quick)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every reader this many times, interleaved (the order reversed every other "
        "round); the report gives each reader's median and its difference to local disk in "
        "the same round, since one run's warm AU moves by several points here",
    )
    ap.add_argument(
        "--compute",
        default="",
        help="emulated compute per step, e.g. unet3d=0.08,resnet50=0.026: skips the search "
        "for local disk's 90%% AU (one run still measures a DLIO process's memory)",
    )
    ap.add_argument(
        "--keep-work",
        action="store_true",
        help="keep --work (datasets, bucket, caches) after a good run; a rerun reuses them",
    )
    ap.add_argument(
        "--page-cache",
        default="512MiB",
        help="page cache the readers (and, apart, the serving daemons) may fill: their "
        "cgroup's memory limit is this plus their own memory "
        f"({PROCESS_MEMORY / GIB:.2f} GiB per DLIO process)",
    )
    ap.add_argument(
        "--free-page-reporting",
        choices=["keep", "off"],
        default="keep",
        help="off: turn the VM's free page reporting off for the run and restore it after "
        "(where a balloon hands free memory back to the host, the first warm epoch after "
        "a cold one through FUSE pays to fault it back in; bare metal has none)",
    )
    ap.add_argument(
        "--endpoint-memory",
        default=None,
        help="cap the S3 endpoint's memory, page cache included (e.g. 1GiB); by default "
        "it is uncapped and the bucket's files it reads stay in this machine's page cache",
    )
    ap.add_argument(
        "--mount-arg",
        action="append",
        default=[],
        help="an extra `lakecache mount` argument (repeat for more): --mount-arg=--attr-ttl=600",
    )
    ap.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="an extra `lakecache worker` argument (repeat for more)",
    )
    a = ap.parse_args()
    try:
        Bench(a).run()
    except summary.SummaryError as e:
        raise BenchError(f"error: {e}") from e


def dlio_entry() -> Path:
    """DLIO's launcher script in the venv of the python running this."""
    return Path(sys.executable).parent / "dlio_benchmark"


def parse_size(text: str) -> int:
    units = {"GiB": GIB, "MiB": 1 << 20}
    for u, m in units.items():
        if text.endswith(u):
            return int(float(text[: -len(u)]) * m)
    return int(text)


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        if os.geteuid() != 0:
            raise BenchError("run as root: FUSE mounts, cgroups and drop_caches need it")
        if not Path(a.bin).is_file():
            raise BenchError(f"{a.bin}: no lakecache binary there (cargo build --release)")
        # The options before anything is looked for or started.
        self.choose(a)
        # Checked early: a run takes up to an hour, and its report is
        # written at the end.
        out_dir = Path(a.out).parent
        if not out_dir.is_dir() or not os.access(out_dir, os.W_OK):
            raise BenchError(
                f"--out {a.out}: {out_dir} is not a writable directory (the report and its "
                "plots go there); create it first"
            )
        # Run with another python, MPI reports only an execvp error in a
        # DLIO log after the bench has started its daemons.
        if not dlio_entry().is_file():
            raise BenchError(
                f"{dlio_entry()}: DLIO is not installed beside this python ({sys.executable}); "
                "run benches/dlio/run.sh, or this script with the python of the venv "
                "that benches/dlio/install.sh prints"
            )
        a.mpirun = shutil.which("mpirun")
        if not a.mpirun:
            raise BenchError("mpirun not found: install MPICH (benches/dlio/install.sh does)")
        if any(self.rtts) and not (a.proxy and Path(a.proxy).is_file()):
            raise BenchError("--proxy must name the delay-proxy binary for an RTT above 0")
        if "s3fs" in self.readers and self.workloads:
            self.s3fs_version = install_s3fs()
        a.files = {
            w.name: (4 if a.smoke else w.files_quick if a.quick else w.files)
            for w in self.workloads
        }
        # On `a` too: the report says which figures were given.
        self.fixed_compute: dict[str, float] = {}
        a.fixed_compute = self.fixed_compute
        for item in filter(None, a.compute.split(",")):
            name, _, value = item.partition("=")
            try:
                self.fixed_compute[name] = float(value)
            except ValueError:
                raise BenchError(f"--compute {item!r}: want WORKLOAD=SECONDS") from None
            if name not in WORKLOADS or self.fixed_compute[name] < 0:
                raise BenchError(
                    f"--compute {item!r}: want WORKLOAD=SECONDS with a workload of "
                    f"{', '.join(WORKLOADS)} and seconds of 0 or more"
                )
        self.check_space()

    def choose(self, a: argparse.Namespace) -> None:
        """What to run, from the options and --quick's defaults; a name
        the bench does not know is refused."""
        if a.smoke:
            a.quick, a.workloads, a.readers, a.rtt_ms = True, "unet3d", "mount-workers", "0"
            a.max_accelerators, a.epochs, a.rounds = 1, 1, 1
        if a.rounds < 1:
            raise BenchError(f"--rounds {a.rounds}: want 1 or more")
        self.round = 0
        if a.quick and a.workloads == "unet3d,resnet50":
            a.workloads = "unet3d"
            a.checkpoint_rounds = 1
            a.max_accelerators = 1
        a.no_compute_runs, a.search_runs = CALIBRATION_RUNS[bool(a.quick)]
        if a.quick and a.checkpoint_targets is None:
            a.checkpoint_targets = ",".join(QUICK_CHECKPOINT_TARGETS)
        if a.checkpoint_targets is None:
            a.checkpoint_targets = ",".join(CHECKPOINT_TARGETS)
        if a.readers is None:
            a.readers = ",".join(QUICK_READERS if a.quick else READERS)
        if a.rtt_ms is None:
            a.rtt_ms = str(QUICK_RTT_MS) if a.quick else "0,10"
        a.checkpoint_targets = a.checkpoint_targets.split(",")
        unknown = set(a.checkpoint_targets) - set(CHECKPOINT_TARGETS)
        if unknown:
            raise BenchError(
                f"--checkpoint-targets: unknown {', '.join(sorted(unknown))}; known: "
                f"{', '.join(CHECKPOINT_TARGETS)}"
            )
        names = [] if a.workloads == "none" else a.workloads.split(",")
        unknown = [n for n in names if n not in WORKLOADS]
        if unknown:
            raise BenchError(
                f"--workloads: unknown {', '.join(unknown)}; known: {', '.join(WORKLOADS)} "
                "(or none: the checkpoints alone)"
            )
        if not names and a.no_checkpoints:
            raise BenchError("--workloads none with --no-checkpoints leaves nothing to run")
        self.workloads = [WORKLOADS[n] for n in names]
        self.readers = a.readers.split(",")
        unknown = set(self.readers) - set(READERS)
        if unknown:
            raise BenchError(f"unknown readers {sorted(unknown)}; known: {', '.join(READERS)}")
        try:
            self.rtts = [int(r) for r in a.rtt_ms.split(",")]
        except ValueError:
            raise BenchError(f"--rtt-ms {a.rtt_ms!r}: want milliseconds, e.g. 0,10") from None

    def check_space(self) -> None:
        a = self.a
        a.work.mkdir(parents=True, exist_ok=True)
        sizes = [a.files[w.name] * w.mean_file_bytes for w in self.workloads]
        # Every dataset on local disk and in the bucket; one at a time in
        # the worker's cache and the tier (or s3fs's cache); 10% spare.
        need = int((2 * sum(sizes) + 2 * max(sizes, default=0)) * 1.1)
        if not (a.smoke or a.no_checkpoints):
            # One run's checkpoints in the bucket, the worker's cache and
            # its write-back staging (each run's are removed after it).
            need += 3 * CHECKPOINT_RUN_BYTES
        have = sum(
            p.stat().st_size
            for d in ("local", "s3")
            for p in (a.work / d).rglob("*")
            if p.is_file()
        )
        free = shutil.disk_usage(a.work).free + have
        if need > free:
            raise BenchError(
                f"the datasets need about {need / GIB:.1f} GiB under {a.work} (local copies, "
                "the bucket, the worker's cache and the tier, and one checkpoint run); "
                f"{free / GIB:.1f} GiB is free"
            )

    def run(self) -> None:
        a = self.a
        started = time.monotonic()
        # First, before anything a killed run left behind can fail this one.
        reporting = PageReporting(saved_file=SAVED_REPORTING)
        left = reporting.recover()
        if left is not None:
            print(
                f"free page reporting: put back to order {left}, which a killed run left off",
                flush=True,
            )
        for stale in (a.work / "mnt",):
            if mounted(stale):
                subprocess.run(["umount", "-l", str(stale)], check=False)
        cache = parse_size(a.page_cache)
        self.reader_cg = Cgroup.create("lakecache-dlio-readers", cache + PROCESS_MEMORY)
        # The mount's memory budget and the worker, beside their page cache.
        self.daemons_cg = Cgroup.create("lakecache-dlio-daemons", DAEMONS_MEMORY)
        self.process_memory = PROCESS_MEMORY
        self.endpoint_cg = (
            Cgroup.create("lakecache-dlio-endpoint", parse_size(a.endpoint_memory))
            if a.endpoint_memory
            else None
        )
        lake = Lake(a, a.work, self.daemons_cg, self.endpoint_cg)
        rows: list[dict] = []
        self.failures: list[str] = []
        off = a.free_page_reporting == "off"
        a.page_reporting_note = reporting.describe(off)
        reported_before = reporting.reported_kib()
        try:
            if off:
                reporting.turn_off()
            for w in self.workloads:
                rows += self.workload(lake, w)
                # Kept, so a later failure loses no measurement.
                (a.work / "rows.json").write_text(json.dumps(rows, indent=1))
            if not a.smoke and not a.no_checkpoints:
                self.ckpt_rows = self.checkpoints(lake)
        finally:
            reporting.restore()
            lake.close()
            self.reader_cg.remove()
            self.daemons_cg.remove()
            if self.endpoint_cg:
                self.endpoint_cg.remove()
        reported_after = reporting.reported_kib()
        if reported_before is not None and reported_after is not None:
            a.page_reporting_note += (
                f"; {(reported_after - reported_before) / 1024:.0f} MiB handed to the host "
                "during the run"
            )
        self.report(rows)
        print(f"the bench ran {(time.monotonic() - started) / 60:.1f} min", flush=True)
        if self.failures:
            raise BenchError(
                f"{len(self.failures)} DLIO run(s) failed (the report shows the rest):\n"
                + "\n".join(self.failures)
            )
        # Tens of GB (datasets on disk and in the bucket, caches, tier);
        # a failed run keeps them for the logs it names.
        if not a.keep_work:
            remove_work(a.work)

    def workload(self, lake: Lake, w: Workload) -> list[dict]:
        a = self.a
        sized = f"{w.name}-{a.files[w.name]}"
        local = a.work / "local" / sized
        if not generated(local, a.files[w.name]):
            generate(a, w, local, self.reader_cg)
        lake.set_rtt(0)
        # Write-back with staged writes: np.savez seeks back to patch its
        # zip headers, which a streamed (write-through) upload refuses.
        lake.start_lakecache(tier=False, write_mode="back")
        bucket_data = lake.mnt / "dlio" / sized
        if not generated(bucket_data, a.files[w.name]):
            generate(a, w, bucket_data, self.reader_cg)
        # In S3 before the worker's cache is emptied for the cold runs.
        subprocess.run(
            [a.bin, "sync", f"s3://{BUCKET}/", "--worker", f"127.0.0.1:{lake.worker_port}"],
            check=True,
            env=lake.env,
            stdout=subprocess.DEVNULL,
        )
        lake.stop_daemons()
        compute_s = self.calibrate(lake, w, local)
        rows = []
        for rnd in range(a.rounds):
            self.round = rnd
            readers = self.readers if rnd % 2 == 0 else self.readers[::-1]
            for reader in readers:
                for rtt in [0] if reader == "local" else self.rtts:
                    rows += self.sweep(lake, w, reader, rtt, local, compute_s, sized)
        return rows

    def calibrate(self, lake: Lake, w: Workload, local: Path) -> float:
        """The compute time per step at which local disk reaches about 90%
        AU with one accelerator (warm epochs, page cache capped). Starts
        from 0.9 of a warm step's length with no compute (the fastest of
        two runs of two epochs; one with --quick: with the loader
        prefetching, AU is about compute over that length once the
        storage is the limit), then halves the interval around 90% for
        at most five runs (two with --quick), keeping the closest."""
        a = self.a
        if a.smoke:
            return w.compute_s
        fixed = self.fixed_compute.get(w.name)
        fastest = 0.0
        for attempt in range(1 if fixed is not None else a.no_compute_runs):
            drop_caches()
            out = a.work / "out" / f"calibrate-{w.name}-{attempt}"
            peak = AnonPeak(self.reader_cg)
            self.reader_cg.set_limit(PROCESS_MEMORY + parse_size(a.page_cache))
            dlio(a, w, local, out, 1, self.reader_cg, train_flags(a, w, 0.0, 2), counter=peak)
            run = summary.load(out / "summary.json")
            fastest = max(fastest, run.warm_samples_s or run.cold_samples_s)
        # The readers' own memory, with a margin: their cgroup's limit is
        # this per process plus the page cache allowed.
        self.process_memory = max(int(peak.peak * 1.5), 512 << 20)
        self.reader_cg.set_limit(self.process_memory + parse_size(a.page_cache))
        print(f"{w.name}: a DLIO process holds up to {peak.peak / GIB:.2f} GiB itself", flush=True)
        step_io_s = w.batch / fastest
        lo, hi, compute = 0.0, None, 0.9 * step_io_s
        tried: list[tuple[float, float]] = []
        if fixed is not None:
            tried.append((fixed, float("nan")))
        for attempt in range(0 if fixed is not None else a.search_runs):
            compute = round(compute, 3)
            drop_caches()
            out = a.work / "out" / f"calibrate-{w.name}-au-{attempt}"
            dlio(a, w, local, out, 1, self.reader_cg, train_flags(a, w, compute, 3))
            run = summary.load(out / "summary.json")
            au = run.warm_au if run.warm_au is not None else run.cold_au
            tried.append((compute, au))
            print(
                f"{w.name}: local disk at {compute} s of compute per step: AU {au:.1f}%", flush=True
            )
            if 88 <= au <= 92:
                break
            if au > 92:
                hi = compute
            else:
                lo = compute
            compute = (lo + hi) / 2 if hi is not None else compute * 2
        compute = min(tried, key=lambda t: abs(t[1] - 90))[0]
        self.scale = getattr(self, "scale", {})
        factor = w.per_sample_factor(compute)
        self.scale[w.name] = (compute, factor, w.batch, w.dlio_batch)
        print(
            f"{w.name}: a warm step of {w.batch} samples with no compute lasts "
            f"{step_io_s:.3f} s on local disk; emulated compute {compute} s per step "
            f"({factor:.2f}x DLIO's H100 figure per sample)",
            flush=True,
        )
        return compute

    def sweep(
        self,
        lake: Lake,
        w: Workload,
        reader: str,
        rtt: int,
        local: Path,
        compute_s: float,
        sized: str,
    ) -> list[dict]:
        """Accelerators 1, 2, ... while warm AU stays at 90% or more."""
        rows = []
        samples = self.a.files[w.name] * w.samples_per_file
        for np_ in range(1, self.a.max_accelerators + 1):
            if samples // (batch_of(self.a, w) * np_) < 3:
                print(
                    f"{w.name} {reader}: {np_} accelerators would get under 3 steps each of "
                    f"{samples} samples; the sweep stops at {np_ - 1}",
                    flush=True,
                )
                break
            row = self.one(lake, w, reader, rtt, local, compute_s, np_, sized)
            if "skipped" in row:
                return [row]
            rows.append(row)
            au = row["warm_au"] if row["warm_au"] is not None else row["cold_au"]
            if au < 90:
                break
        return rows

    def one(
        self,
        lake: Lake,
        w: Workload,
        reader: str,
        rtt: int,
        local: Path,
        compute_s: float,
        np_: int,
        sized: str,
    ) -> dict:
        a = self.a
        lake.set_rtt(rtt)
        env: dict[str, str] = {}
        extra = train_flags(a, w, compute_s, a.epochs)
        data = local
        if reader in (
            "mount-workers",
            "mount-tier",
            "mount-tier-whole",
            "pyclient",
            "pyclient-tier",
        ):
            lake.start_lakecache(
                tier=reader.startswith("mount-tier") or reader == "pyclient-tier",
                tier_whole=reader == "mount-tier-whole",
            )
            data = lake.mnt / "dlio" / sized
            if reader.startswith("pyclient"):
                if w.name != "unet3d":
                    lake.stop_daemons()
                    return self.skipped(w, reader, rtt, np_, "the plugin reads NPZ only")
                extra.append(
                    "++workload.reader.reader_classname=lakecache_reader.LakecacheNPZReader"
                )
                env = {
                    "PYTHONPATH": str(HERE),
                    "LAKECACHE_DLIO_ROOT": str(lake.mnt),
                    "LAKECACHE_DLIO_URI": f"s3://{BUCKET}",
                    "LAKECACHE_DLIO_WORKER": f"127.0.0.1:{lake.worker_port}",
                    "LAKECACHE_DLIO_COUNTS": str(a.work / "out" / "counts"),
                }
                if reader == "pyclient-tier":
                    # Through the mount's node-local tier (its socket).
                    env["LAKECACHE_DLIO_LOCAL_CACHE"] = str(lake.work / "tier")
                shutil.rmtree(a.work / "out" / "counts", ignore_errors=True)
                (a.work / "out" / "counts").mkdir(parents=True)
        elif reader == "s3fs":
            lake.start_s3fs()
            data = lake.mnt / "dlio" / sized
        drop_caches()
        daemons = lake.daemon_pids()
        before = {p: cpu.process_seconds(p) for p in daemons}
        counter = ReadCounter(self.reader_cg)
        out = a.work / "out" / f"{w.name}-{reader}-{rtt}ms-{np_}-r{self.round}"
        # The Python client's processes get twice the allowance: at 1x
        # their warm AU fell from 38-39% to 34-35% (reclaim inside the
        # cgroup), and before its reads made a single copy they were
        # OOM-killed at 1x. They fill no page cache with it.
        own = self.process_memory * (2 if reader.startswith("pyclient") else 1)
        self.reader_cg.set_limit(parse_size(a.page_cache) + np_ * own)
        started = time.monotonic()
        tier = None
        oom_before = self.reader_cg.oom_kills()
        try:
            dlio(a, w, data, out, np_, self.reader_cg, extra, env, counter)
            tier = lake.tier_state()
        except BenchError as e:
            # One reader failing leaves the rest of the matrix to run; the
            # report shows the failure, and the bench exits non-zero.
            oom = self.reader_cg.oom_kills() - oom_before
            why = f"{e}" + (
                f" ({oom} of its processes killed at the readers' memory limit)" if oom else ""
            )
            self.failures.append(f"{w.name} {reader} {rtt} ms x{np_}: {why}")
            return self.skipped(w, reader, rtt, np_, f"failed: {why}")
        finally:
            daemon_cpu = sum(
                cpu.process_seconds(p) - before[p] for p in daemons if Path(f"/proc/{p}").exists()
            )
            lake.stop_daemons()
        wall = time.monotonic() - started
        run = summary.load(out / "summary.json")
        read = counter.total()
        if reader.startswith("pyclient"):
            read = pyclient_bytes(a.work / "out" / "counts")
        stats = out / "per_epoch_stats.json"
        epoch_s = summary.epoch_seconds(stats.read_text(), str(stats))
        train_s = sum(epoch_s)
        row = {
            "workload": w.name,
            "reader": reader,
            "rtt": rtt,
            "np": np_,
            "round": self.round,
            "cold_au": run.cold_au,
            "last_au": run.last_au,
            "epoch_au": run.au,
            "warm_au": run.warm_au,
            "cold_samples_s": run.cold_samples_s,
            "warm_samples_s": run.warm_samples_s,
            "epoch_s": epoch_s,
            "mib_s": read / 2**20 / train_s if train_s else 0.0,
            "cold_wait_s": summary.data_wait_s(run.cold_au, compute_s),
            "warm_wait_s": (
                summary.data_wait_s(run.warm_au, compute_s) if run.warm_au is not None else None
            ),
            "cpu_per_gib": daemon_cpu / (read / GIB) if read and daemons else None,
            "wall_s": wall,
        }
        if tier:
            row["tier"] = tier
        print(
            f"{w.name} {reader} {rtt} ms x{np_}: AU cold {row['cold_au']:.1f}% warm "
            f"{_f(row['warm_au'])}% last {row['last_au']:.1f}%, {row['mib_s']:.0f} MiB/s read"
            + (
                f"; tier after the run: {tier['whole']} whole, {tier['partial']} partial "
                f"({tier['missing_bytes'] / 2**20:.0f} MiB missing), fills dropped "
                f"{tier['fill_dropped_bytes'] / 2**20:.0f} MiB (waited for "
                f"{tier['fill_waited_bytes'] / 2**20:.0f} MiB), completion fetched "
                f"{tier['completion_fetched_bytes'] / 2**20:.0f} MiB"
                if tier
                else ""
            ),
            flush=True,
        )
        return row

    def skipped(self, w, reader, rtt, np_, why) -> dict:
        print(f"{w.name} {reader}: skipped ({why})", flush=True)
        return {"workload": w.name, "reader": reader, "rtt": rtt, "np": np_, "skipped": why}

    def checkpoints(self, lake: Lake) -> list[dict]:
        """megatron_deepspeed (scaled) writing its checkpoints to local disk
        and through the mount in write-back and write-through mode: the
        time DLIO spends in each checkpoint (its per-epoch `ckptN`), in
        interleaved rounds."""
        a, w = self.a, MEGATRON
        data = a.work / "local" / "megatron"
        if not generated(data, 1):
            dlio(
                a,
                w,
                data,
                a.work / "out" / "gen-megatron",
                1,
                self.reader_cg,
                [
                    "++workload.workflow.generate_data=True",
                    "++workload.workflow.train=False",
                    "++workload.workflow.checkpoint=False",
                ],
            )
        lake.set_rtt(0)
        # The checkpoint's tensors and torch.save's buffers (about 1 GiB
        # here), and room for the page cache the local writes fill.
        self.reader_cg.set_limit(CHECKPOINT_MEMORY)
        rows = []
        for rnd in range(a.checkpoint_rounds):
            targets = a.checkpoint_targets[:: 1 if rnd % 2 == 0 else -1]
            for target in targets:
                ckpt = a.work / "ckpt-local"
                shutil.rmtree(ckpt, ignore_errors=True)
                if target.startswith("mount-"):
                    lake.start_lakecache(tier=False, write_mode=target.split("-")[1])
                    ckpt = lake.mnt / "ckpt" / f"{target}-{rnd}"
                ckpt.mkdir(parents=True, exist_ok=True)
                drop_caches()
                out = a.work / "out" / f"ckpt-{target}-{rnd}"
                try:
                    written = self.checkpoint_run(lake, target, data, ckpt, out)
                except BenchError as e:
                    # Recorded, and the other runs go on: a failed round
                    # must not lose the whole matrix's report.
                    self.failures.append(f"checkpoint {target} round {rnd}: {e}")
                    print(f"checkpoint {target} round {rnd}: failed ({e})", flush=True)
                    rows.append({"target": target, "round": rnd, "failed": str(e)})
                    continue
                stats = json.loads((out / "per_epoch_stats.json").read_text())
                times = [
                    float(v["duration"])
                    for e in stats.values()
                    for k, v in e.items()
                    if k.startswith("ckpt")
                ]
                if not times:
                    why = f"DLIO wrote no checkpoint; see {out / 'run.log'}"
                    self.failures.append(f"checkpoint {target} round {rnd}: {why}")
                    rows.append({"target": target, "round": rnd, "failed": why})
                    continue
                rows.append({"target": target, "round": rnd, "ckpt_s": times, "bytes": written})
                print(
                    f"checkpoint {target} round {rnd}: "
                    f"{', '.join(f'{t:.2f}' for t in times)} s, {written / 2**20:.0f} MiB",
                    flush=True,
                )
        return rows

    def checkpoint_run(self, lake: Lake, target: str, data: Path, ckpt: Path, out: Path) -> int:
        """One DLIO checkpoint run; its checkpoints are removed after it
        (through the mount for a mount target), so rounds do not fill the
        disk. Returns the bytes it wrote."""
        env = None
        if target == "local-fsync":
            path = os.environ.get("PYTHONPATH")
            env = {"PYTHONPATH": f"{DURABLE_LOCAL}:{path}" if path else str(DURABLE_LOCAL)}
        try:
            dlio(
                self.a,
                MEGATRON,
                data,
                out,
                1,
                self.reader_cg,
                [
                    "++workload.workflow.generate_data=False",
                    "++workload.workflow.train=True",
                    "++workload.workflow.checkpoint=True",
                    f"++workload.checkpoint.checkpoint_folder={ckpt}",
                ],
                env=env,
            )
            if target == "local-fsync" and "checkpoints are fsynced" not in (
                out / "run.log"
            ).read_text(errors="replace"):
                raise BenchError(
                    f"local-fsync: DLIO's checkpoint save was not patched; see {out / 'run.log'}"
                )
            return sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
        finally:
            shutil.rmtree(ckpt, ignore_errors=True)
            lake.stop_daemons()

    def report(self, rows: list[dict]) -> None:
        import report

        report.write(
            self.a,
            rows,
            getattr(self, "scale", {}),
            getattr(self, "s3fs_version", None),
            getattr(self, "ckpt_rows", []),
        )


def _f(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


if __name__ == "__main__":
    main()
