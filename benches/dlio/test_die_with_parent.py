"""The benches' daemons die with the bench, kill -9 included: a bench
killed that way once left its S3 endpoint and proxy running, and the next
run on the same work directory failed with only "port N never opened"."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# A bench stand-in: starts a long sleep as the benches start their daemons,
# prints its pid, and waits to be killed.
PARENT = f"""
import subprocess, sys, time
sys.path.insert(0, {str(HERE.parent / "fio")!r})
from run import die_with_parent
child = subprocess.Popen(["sleep", "600"], preexec_fn=die_with_parent)
print(child.pid, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie not yet reaped by init is gone for our purpose.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def test_a_daemon_gets_sigterm_when_its_bench_is_killed_with_sigkill() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert alive(child), "the daemon stand-in did not start"
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=30)
    deadline = time.monotonic() + 30
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive(child):
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the daemon outlived its bench killed with -9")
