"""CPU time per GiB moved, printed beside every throughput.

A measurement's CPU is everything that worked to move its bytes on this
machine: this process (the Python readers and writers of some tests), the
processes it waited for during the measurement (fio and its job processes)
and the daemons serving the path (lakecache's worker and mount, or a peer's
FUSE daemon), read from /proc. The S3 endpoint and the delay proxy stand in
for a remote data lake and are left out.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Iterable

_TICKS = os.sysconf("SC_CLK_TCK")


def process_seconds(pid: int) -> float:
    """User + system CPU of one live process, all its threads."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError as e:
        raise SystemExit(f"cannot read the CPU time of process {pid}: {e}") from e
    # Fields after the command name, which may hold spaces: utime and stime
    # are fields 14 and 15 of the whole line.
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _own_seconds() -> float:
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        use = resource.getrusage(who)
        total += use.ru_utime + use.ru_stime
    return total


class Meter:
    """CPU used from its creation on by this process, the children it
    waits for meanwhile, and the given live daemons."""

    def __init__(self, daemons: Iterable[int | None] = ()) -> None:
        self.pids = [p for p in daemons if p is not None]
        self.start = self._now()

    def _now(self) -> float:
        # A daemon that exits meanwhile takes its CPU with it; reading it
        # then fails instead of giving a number that is too low.
        return _own_seconds() + sum(process_seconds(p) for p in self.pids)

    def seconds(self) -> float:
        return self._now() - self.start

    def per_gib(self, moved: float) -> float:
        if moved <= 0:
            raise SystemExit("a measurement moved no bytes, so it has no CPU per GiB")
        return self.seconds() / (moved / 2**30)


def measured(run: Callable[[], dict], daemons: Iterable[int | None] = ()) -> dict:
    """Runs one measurement and adds `cpu_per_gib` to its result, which
    must carry the `bytes` it moved."""
    meter = Meter(daemons)
    result = run()
    result["cpu_per_gib"] = meter.per_gib(result.get("bytes", 0))
    return result
