"""Memory cgroups for the DLIO bench: the readers' and the serving
daemons' page cache capped (cgroup v2 `memory.max` or v1
`memory.limit_in_bytes`), and what their processes read and hold."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path


class BenchError(SystemExit):
    pass


@dataclass
class Cgroup:
    """A memory cgroup (v2 `memory.max`, or v1 `memory.limit_in_bytes`)
    whose limit covers the page cache its processes fill."""

    path: Path
    limit_file: str

    def set_limit(self, limit: int) -> None:
        (self.path / self.limit_file).write_text(str(limit))

    @staticmethod
    def create(name: str, limit: int) -> Cgroup:
        v2 = Path("/sys/fs/cgroup")
        if "memory" in _read(v2 / "cgroup.controllers").split():
            base = v2 / _own_cgroup("0", "").lstrip("/")
            path, limit_file = base / name, "memory.max"
            _write(base / "cgroup.subtree_control", "+memory", ok_fail=True)
        else:
            v1 = Path("/sys/fs/cgroup/memory")
            if not v1.is_dir():
                raise BenchError("no memory cgroup (v2 memory.max or v1 memory controller)")
            path = v1 / _own_cgroup("", "memory").lstrip("/") / name
            limit_file = "memory.limit_in_bytes"
        try:
            path.mkdir(exist_ok=True)
            (path / limit_file).write_text(str(limit))
        except OSError as e:
            raise BenchError(f"cannot create the memory cgroup {path}: {e} (run as root)") from e
        return Cgroup(path, limit_file)

    def oom_kills(self) -> int:
        """Processes killed at this cgroup's limit so far (v2 `memory.events`,
        v1 `memory.oom_control`, each with an `oom_kill` line)."""
        for name in ("memory.events", "memory.oom_control"):
            for line in _read(self.path / name).splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def procs(self) -> list[int]:
        return [int(p) for p in _read(self.path / "cgroup.procs").split()]

    def remove(self) -> None:
        for _ in range(50):
            if not self.procs():
                break
            time.sleep(0.1)
        try:
            self.path.rmdir()
        except OSError:
            pass

    def prefix(self) -> list[str]:
        """A command prefix that runs the command inside this cgroup."""
        return ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "sh"]


def _own_cgroup(hierarchy: str, controller: str) -> str:
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        num, ctrls, path = line.split(":", 2)
        if (hierarchy and num == hierarchy) or (controller and controller in ctrls.split(",")):
            return path
    return "/"


def _read(p: Path) -> str:
    try:
        return p.read_text()
    except OSError:
        return ""


def _write(p: Path, text: str, ok_fail: bool = False) -> None:
    try:
        p.write_text(text)
    except OSError:
        if not ok_fail:
            raise


class ReadCounter:
    """Bytes the reader processes read (rchar of every process in their
    cgroup, DataLoader workers included), polled while they run."""

    def __init__(self, cg: Cgroup) -> None:
        self.cg, self.seen, self.stop = cg, {}, False

    def poll(self) -> None:
        for pid in self.cg.procs():
            try:
                for line in Path(f"/proc/{pid}/io").read_text().splitlines():
                    if line.startswith("rchar:"):
                        self.seen[pid] = max(self.seen.get(pid, 0), int(line.split()[1]))
            except OSError:
                pass

    def total(self) -> int:
        return sum(self.seen.values())


class AnonPeak:
    """The most anonymous memory the cgroup's processes held, polled."""

    def __init__(self, cg: Cgroup) -> None:
        self.cg, self.peak = cg, 0

    def poll(self) -> None:
        self.peak = max(self.peak, anon_bytes(self.cg))


def anon_bytes(cg: Cgroup) -> int:
    """Anonymous memory charged to the cgroup now (v1 `total_rss`, v2 `anon`)."""
    for line in _read(cg.path / "memory.stat").splitlines():
        key, _, value = line.partition(" ")
        if key in ("total_rss", "anon"):
            return int(value)
    return 0
