"""CPU time per GiB moved, printed beside every throughput.

A measurement's CPU is everything that worked to move its bytes on this
machine: the reader or writer (fio's jobs, as fio reports them, or this
process's own threads in the Python tests) and the daemons serving the path
(lakecache's worker and mount, or a peer's FUSE daemon), read from /proc.
fio's own start-up and file layout are left out, as they are not part of
the I/O (counted from fio's rusage they were most of local disk's figure on
small files). The S3 endpoint and the delay proxy stand in for a remote
data lake and are left out too.
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


def fio_seconds(job: dict) -> float:
    """CPU of one fio result's jobs while they ran (`usr_cpu`/`sys_cpu` are
    percentages of `job_runtime`, which group_reporting sums over jobs)."""
    try:
        return (job["usr_cpu"] + job["sys_cpu"]) / 100 * job["job_runtime"] / 1000
    except KeyError as e:
        raise SystemExit(f"fio's JSON has no {e} (fio 3.x reports it)") from e


def _own_seconds() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


class Meter:
    """CPU used from its creation on by this process and the given live
    daemons (add a fio run's own with `fio_seconds`)."""

    def __init__(self, daemons: Iterable[int | None] = ()) -> None:
        self.pids = [p for p in daemons if p is not None]
        self.start = self._now()

    def _now(self) -> float:
        # A daemon that exits meanwhile takes its CPU with it; reading it
        # then fails instead of giving a number that is too low.
        return _own_seconds() + sum(process_seconds(p) for p in self.pids)

    def seconds(self) -> float:
        return self._now() - self.start

    def per_gib(self, moved: float, extra_s: float = 0.0) -> float:
        """Per GiB of `moved` bytes, with `extra_s` (fio's own) added."""
        if moved <= 0:
            raise SystemExit("a measurement moved no bytes, so it has no CPU per GiB")
        return (self.seconds() + extra_s) / (moved / 2**30)


def measured(run: Callable[[], dict], daemons: Iterable[int | None] = ()) -> dict:
    """Runs one measurement and adds `cpu_per_gib` to its result, which
    must carry the `bytes` it moved and, when fio ran, fio's `fio_cpu_s`."""
    meter = Meter(daemons)
    result = run()
    result["cpu_per_gib"] = meter.per_gib(result.get("bytes", 0), result.get("fio_cpu_s", 0.0))
    return result
