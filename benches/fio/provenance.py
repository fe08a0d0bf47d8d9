"""Where a results file came from: every table under benches/results is
written by the command that measured it, with that command, the commit it
ran at and the machine at the top, and printed to stdout as well."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _mem_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return 0.0


def header(argv: list[str] | None = None) -> list[str]:
    """Markdown lines: the exact command, the commit, the machine, the time."""
    argv = sys.argv if argv is None else argv
    commit = _git("rev-parse", "HEAD") or "unknown (not a git checkout)"
    changed = _git("status", "--porcelain", "--untracked-files=no")
    dirty = " with uncommitted changes" if changed else ""
    return [
        f"Command: `python3 {shlex.join(argv)}`",
        f"Commit: {commit}{dirty}",
        (
            f"Machine: {os.cpu_count()} cores ({_cpu_model()}), {_mem_gib():.0f} GiB, "
            f"kernel {platform.release()}"
        ),
        f"Recorded: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
    ]


def write(out: str | Path, lines: list[str]) -> None:
    """Prints the results and writes them to `out`."""
    text = "\n".join(lines) + "\n"
    print(text, end="")
    Path(out).write_text(text)
