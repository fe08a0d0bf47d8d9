"""The first warm pass through the node-local tier, apart from DLIO.

In the DLIO runs the first warm epoch through the mount's tier is the
slowest warm one (UNet3D: 61-79% AU where later epochs reach 95%), while
local disk shows no such dip. This reads a dataset the way those runs do,
with plain sequential reads and no DLIO:

- through the mount: a cold pass (fetched from S3, filling the tier), then
  two warm passes (FUSE passthrough from the tier);
- from local disk: the same three passes, after the page cache is dropped;

each in a reader memory cgroup capped below the dataset's size (as the
DLIO bench caps its readers), and each twice: as is, and with `--pretouch`
GiB of memory written and freed by another process just before the first
warm pass. If that pass is slow only where nothing touched memory first,
the cost is the machine's first touch of memory it has not used for a while
(a VM whose balloon returns free pages to the host), not the data path.

    python3 benches/dlio/first_warm_pass.py --bin target/release/lakecache
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "fio"))

import provenance  # noqa: E402
from cgroup import BenchError, Cgroup  # noqa: E402
from lake import DAEMONS_MEMORY, Lake  # noqa: E402
from page_reporting import PageReporting  # noqa: E402
from run import drop_caches  # noqa: E402

MIB = 1 << 20
CHUNK = 4 * MIB
# Local disk's passes 1 and 2 right after a cold pass through the mount
# (the mount stopped in between): whether a slow first warm pass is the
# tier's read path or whatever reads first after the cold pass.
MOUNT_COLD_THEN_LOCAL = "mount-cold-then-local"
READERS = ("mount-tier", "local", MOUNT_COLD_THEN_LOCAL)
# Reads every file under argv[1] in 4 MiB reads, as DLIO's NPZ reader
# reads a whole file; prints the bytes read.
READ_ALL = """
import os, sys
n = 0
for name in sorted(os.listdir(sys.argv[1])):
    with open(os.path.join(sys.argv[1], name), "rb", buffering=0) as f:
        while chunk := f.read(4 << 20):
            n += len(chunk)
print(n)
"""


def read_pass(cg: Cgroup, root: Path, want: int) -> tuple[float, float]:
    """Wall and system CPU seconds of one whole pass over `root`."""
    started = time.monotonic()
    p = subprocess.Popen(
        cg.prefix() + [sys.executable, "-c", READ_ALL, str(root)],
        stdout=subprocess.PIPE,
        text=True,
    )
    out = p.stdout.read() if p.stdout else ""
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.monotonic() - started
    if os.waitstatus_to_exitcode(status) != 0 or int(out.strip() or 0) != want:
        raise BenchError(f"a pass over {root} failed or read {out.strip()!r} of {want} bytes")
    return wall, usage.ru_stime


def file_hugepages() -> int:
    """2 MiB page-cache folios in the machine now (`nr_file_hugepages`)."""
    for line in Path("/proc/vmstat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "nr_file_hugepages":
            return int(value)
    return 0


def measured_pass(cg: Cgroup, root: Path, want: int) -> tuple[float, float, int]:
    """`read_pass`, and the 2 MiB page-cache folios the machine gained
    meanwhile: the kernel builds them from free 2 MiB blocks, the size
    this VM's balloon hands back to its host once they have been free a
    while, so a pass that reads into them touches memory the host took."""
    before = file_hugepages()
    wall, sys_s = read_pass(cg, root, want)
    return wall, sys_s, file_hugepages() - before


def reported_mib() -> float | None:
    """Free guest memory handed back to the host so far (virtio-balloon
    free page reporting), where the kernel says."""
    kib = PageReporting().reported_kib()
    return None if kib is None else kib / 1024


def touch_memory(gib: int) -> None:
    """Writes `gib` GiB of anonymous memory in another process, then frees it."""
    subprocess.run([sys.executable, "-c", f"bytearray({gib} << 30)"], check=True)


def write_dataset(lake: Lake, local: Path, files: int, size: int) -> None:
    """The same random files into the bucket (through the mount) and `local`."""
    lake.start_lakecache(tier=False)
    remote = lake.mnt / "ds"
    remote.mkdir(exist_ok=True)
    local.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        name = f"f{i:03}"
        with open(remote / name, "wb") as r, open(local / name, "wb") as w:
            left = size
            while left:
                chunk = os.urandom(min(CHUNK, left))
                r.write(chunk)
                w.write(chunk)
                left -= len(chunk)
    lake.stop_daemons()


def extents(files: list[Path]) -> str:
    """The files' extent counts (filefrag): median and range."""
    counts = []
    for f in files:
        out = subprocess.run(["filefrag", "-s", str(f)], capture_output=True, text=True, check=True)
        # "PATH: N extents found" (or "1 extent found")
        counts.append(int(out.stdout.rsplit(":", 1)[1].split()[0]))
    if not counts:
        return "n/a"
    counts.sort()
    return f"{counts[len(counts) // 2]} ({counts[0]}-{counts[-1]})"


def mib_text(mib: float | None) -> str:
    return "n/a" if mib is None else f"{mib:.0f} MiB"


def machine_facts() -> list[str]:
    balloon = Path("/sys/bus/virtio/drivers/virtio_balloon")
    bound = balloon.is_dir() and any(p.name.startswith("virtio") for p in balloon.iterdir())
    damon = Path("/sys/kernel/mm/damon/admin/kdamonds/nr_kdamonds")
    kdamonds = damon.read_text().strip() if damon.exists() else "0"
    running = subprocess.run(["pgrep", "-c", "kdamond"], capture_output=True, text=True)
    # What the kdamonds do (a `pageout` scheme reclaims memory unused for a while).
    actions = sorted(
        {
            p.read_text().strip()
            for p in Path("/sys/kernel/mm/damon/admin/kdamonds").glob(
                "*/contexts/*/schemes/*/action"
            )
        }
    )
    return [
        f"virtio balloon device bound: {'yes' if bound else 'no'};"
        f" free page reporting counter: {'no' if reported_mib() is None else 'yes'}",
        f"DAMON: {kdamonds} kdamonds configured by sysfs, "
        f"{running.stdout.strip() or '0'} kdamond threads running; scheme actions:"
        f" {', '.join(actions) or 'none'}",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", required=True, help="the release lakecache binary")
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/lakecache-first-warm"))
    ap.add_argument("--files", type=int, default=24)
    ap.add_argument("--file-mib", type=int, default=146, help="UNet3D's sample size")
    ap.add_argument("--reader-gib", type=int, default=2, help="the readers' memory cap")
    ap.add_argument("--pretouch", type=int, default=4, help="GiB touched before pass 1")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=HERE.parent / "results" / "first-warm-pass.md")
    a = ap.parse_args()
    a.proxy = None
    if a.files * a.file_mib * MIB <= a.reader_gib << 30:
        raise BenchError("the dataset must exceed --reader-gib, or the page cache serves it")
    a.work.mkdir(parents=True, exist_ok=True)
    readers = Cgroup.create("lakecache-first-warm-readers", a.reader_gib << 30)
    daemons = Cgroup.create("lakecache-first-warm-daemons", DAEMONS_MEMORY)
    lake = Lake(a, a.work, daemons)
    size = a.file_mib * MIB
    want = a.files * size
    local = a.work / "local" / "ds"
    rows = []
    try:
        write_dataset(lake, local, a.files, size)
        for run in range(1, a.runs + 1):
            for pretouch in (False, True):
                for reader in READERS:
                    through_mount = reader != "local"
                    if through_mount:
                        lake.start_lakecache(tier=True)
                    drop_caches()
                    passes = [
                        measured_pass(readers, lake.mnt / "ds" if through_mount else local, want)
                    ]
                    # The control: local disk read right after the mount's
                    # cold pass, where the tier's first warm pass would be.
                    root = lake.mnt / "ds" if reader == "mount-tier" else local
                    if reader == MOUNT_COLD_THEN_LOCAL:
                        lake.stop_daemons()
                    # Of the files passes 1 and 2 read.
                    files = (
                        sorted((a.work / "tier").glob("*.data"))
                        if reader == "mount-tier"
                        else sorted(local.iterdir())
                    )
                    frag = extents(files)
                    before = reported_mib()
                    if pretouch:
                        touch_memory(a.pretouch)
                    passes.append(measured_pass(readers, root, want))
                    after = reported_mib()
                    passes.append(measured_pass(readers, root, want))
                    handed = None if before is None or after is None else after - before
                    if reader == "mount-tier":
                        lake.stop_daemons()
                    row = (
                        reader,
                        f"{a.pretouch} GiB" if pretouch else "no",
                        run,
                        passes,
                        handed,
                        frag,
                    )
                    rows.append(row)
                    print(
                        f"{reader} run {run} pretouch {row[1]}: "
                        + ", ".join(
                            f"{w:.2f} s ({s:.2f} sys, +{h} 2 MiB folios)" for w, s, h in passes
                        )
                        + f"; handed to the host around pass 1: {mib_text(handed)}"
                        + f"; extents per file {frag}",
                        flush=True,
                    )
    finally:
        lake.close()
        readers.remove()
        daemons.remove()
    gib = want / (1 << 30)
    lines = [
        "# The first warm pass through the node-local tier, without DLIO",
        "",
        *provenance.header(),
        "",
        *[f"- {f}" for f in machine_facts()],
        "",
        f"{a.files} files of {a.file_mib} MiB ({gib:.2f} GiB), read whole in 4 MiB reads by"
        f" one process in a memory cgroup of {a.reader_gib} GiB. Pass 0 is cold (the page"
        " cache dropped; through the mount, fetched from the local S3 endpoint and filling"
        " the tier); passes 1 and 2 follow at once (through the mount: FUSE passthrough from"
        " the tier). `pretouch`: that much memory written and freed by another process"
        " between pass 0 and pass 1. Seconds of wall time; in brackets system CPU, and the"
        " 2 MiB page-cache folios the machine gained in the pass (`nr_file_hugepages`)."
        " Handed to the host: free memory the guest reported to its host from the end"
        " of pass 0 to the end of pass 1 (`reported_kib`). Extents: each data file's"
        " extent count after pass 0 (`filefrag`; of the files passes 1 and 2 read),"
        " median and range."
        f" `{MOUNT_COLD_THEN_LOCAL}`: pass 0 through the mount (as `mount-tier`), the mount"
        " stopped, then passes 1 and 2 from local disk: the first pass after the mount's"
        " cold pass, on files that are not the tier's.",
        "",
        "| reader | pretouch | run | pass 0 (cold) | pass 1 (first warm) | pass 2"
        " | handed to the host | extents per file |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for reader, pretouch, run, passes, handed, frag in rows:
        cells = " | ".join(f"{w:.2f} s ({s:.2f}; {h:+})" for w, s, h in passes)
        lines.append(f"| {reader} | {pretouch} | {run} | {cells} | {mib_text(handed)} | {frag} |")
    provenance.write(a.out, lines)


if __name__ == "__main__":
    main()
