"""Profiles DLIO's loader processes in warm epochs: runs dlio_bench.py
(one round, the arguments given after `--`) under a system-wide `perf
record`, then counts the loaders' samples by symbol between epoch 3's
start and epoch 8's end of each reader's run, from DLIO's own epoch
times. How the per-byte costs of local disk and the tier were compared
for issue #34 (results/dlio-loader-profile-fpr-1206.md).

    <DLIO venv>/bin/python benches/dlio/profile_loaders.py \\
        --work /var/tmp/dlio-m --perf-data /var/tmp/prof.data -- <dlio_bench.py arguments>

Run it with the python of the venv that benches/dlio/install.sh prints
(dlio_bench.py runs under the same one), as root.
"""

from __future__ import annotations

import argparse
import datetime
import json
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# DLIO's PyTorch loader workers name themselves so.
LOADER_COMM = "pt_data_worker"
SYMBOLS = ("_copy_to_iter", "clear_page_erms", "__memmove_avx512_unaligned_erms", "crc32_z")


def epoch_window(stats: Path, first: int, last: int) -> tuple[float, float]:
    """Unix seconds of epoch `first`'s start and `last`'s end (DLIO
    writes UTC times without a zone)."""
    epochs = json.loads(stats.read_text())

    def ts(s: str) -> float:
        return datetime.datetime.fromisoformat(s).replace(tzinfo=datetime.UTC).timestamp()

    return ts(epochs[str(first)]["start"]), ts(epochs[str(last)]["end"])


def samples_by_symbol(report: str) -> dict[str, int]:
    """`perf report -n --sort sym --stdio` lines: percent, samples, kind, symbol."""
    counts: dict[str, int] = {}
    for line in report.splitlines():
        parts = line.split()
        if line.startswith("#") or len(parts) < 4 or not parts[1].isdigit():
            continue
        counts[parts[-1]] = counts.get(parts[-1], 0) + int(parts[1])
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="dlio_bench.py's --work")
    ap.add_argument("--perf-data", type=Path, required=True)
    ap.add_argument("--first-epoch", type=int, default=3)
    ap.add_argument("--last-epoch", type=int, default=8)
    ap.add_argument("bench_args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    bench = [arg for arg in a.bench_args if arg != "--"]
    perf = subprocess.Popen(
        ["perf", "record", "-q", "-a", "-g", "-k", "CLOCK_REALTIME", "-F", "499"]
        + ["-o", str(a.perf_data)]
    )
    try:
        run = [sys.executable, str(HERE / "dlio_bench.py"), "--work", str(a.work), *bench]
        if subprocess.run(run + ["--rounds", "1"]).returncode != 0:
            raise SystemExit("dlio_bench.py failed (its message is above); nothing to profile")
    finally:
        perf.send_signal(signal.SIGINT)
        perf.wait()
    for stats in sorted((a.work / "out").glob("*-r0/per_epoch_stats.json")):
        start, end = epoch_window(stats, a.first_epoch, a.last_epoch)
        report = subprocess.run(
            ["perf", "report", "-i", str(a.perf_data), "--time", f"{start:.6f},{end:.6f}"]
            + ["--comm", LOADER_COMM, "--no-children", "-g", "none", "-n", "--sort", "sym"]
            + ["--stdio"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        counts = samples_by_symbol(report)
        picked = ", ".join(f"{s} {counts.get(s, 0)}" for s in SYMBOLS)
        print(
            f"{stats.parent.name}: epochs {a.first_epoch}-{a.last_epoch} {end - start:.1f} s, "
            f"{sum(counts.values())} loader samples; {picked}",
            flush=True,
        )


if __name__ == "__main__":
    main()
