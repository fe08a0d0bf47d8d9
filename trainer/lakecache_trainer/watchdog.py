"""Stuck-step watchdog: a job that makes no progress for --stuck-timeout
ends with EXIT_STUCK and says why, instead of holding GPUs for hours.

Progress is a completed optimizer step (or a finished startup phase or
checkpoint save). A phase may carry its own limit instead: building the
model and the DeepSpeed engine is compute (imports, kernel builds,
sharding) whose length grows with the model and the machine's load, not a
read that waits. When no progress arrives in time, the rank prints every
thread's Python stack, the reads the lakecache mount is waiting on (its
`/v1/inflight` list, when the mount serves metrics), and one line naming
the last good checkpoint, then exits.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable

EXIT_STUCK = 75
INFLIGHT_ENV = "LAKECACHE_MOUNT_METRICS"


def fetch_inflight(address: str, timeout: float = 2.0) -> str:
    """The mount's in-flight operations, one per line, oldest first."""
    url = address if "://" in address else f"http://{address}"
    url = url.rstrip("/") + "/v1/inflight"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (operator-given)
            ops = json.loads(resp.read())["operations"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"  (could not read {url}: {e})"
    if not ops:
        return "  (none)"
    return "\n".join("  " + json.dumps(op, sort_keys=True) for op in ops)


def thread_stacks() -> str:
    """Every thread's Python stack, named, innermost call last."""
    frames = sys._current_frames()
    out = []
    for t in threading.enumerate():
        frame = frames.get(t.ident) if t.ident is not None else None
        if frame is None:
            continue
        out.append(f'Thread "{t.name}" (id {t.ident}, daemon={t.daemon}):')
        out.extend(line.rstrip("\n") for line in traceback.format_stack(frame))
    return "\n".join(out)


class StepWatchdog:
    def __init__(
        self,
        timeout_s: float,
        rank: int,
        last_checkpoint: Callable[[], str | None],
        mount_metrics: str | None = None,
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        self.timeout_s = timeout_s
        self.rank = rank
        self.last_checkpoint = last_checkpoint
        self.mount_metrics = mount_metrics
        self._exit = exit
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._phase = "starting"
        self._phase_timeout_s: float | None = None
        self._step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stuck-watchdog", daemon=True)

    def start(self) -> StepWatchdog:
        self._thread.start()
        return self

    def progress(self, phase: str, step: int | None = None, timeout_s: float | None = None) -> None:
        """Something finished; `phase` is what runs next, bounded by
        `timeout_s` when given, else by the watchdog's timeout."""
        with self._lock:
            self._last = time.monotonic()
            self._phase = phase
            self._phase_timeout_s = timeout_s
            if step is not None:
                self._step = step

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            with self._lock:
                idle = time.monotonic() - self._last
                phase, step = self._phase, self._step
                limit = self._phase_timeout_s or self.timeout_s
            if idle >= limit:
                self._fire(idle, phase, step)
                return

    def _fire(self, idle: float, phase: str, step: int) -> None:
        err = sys.stderr
        print(
            f"\n=== lakecache-train stuck-step watchdog, rank {self.rank}: "
            f"no progress for {idle:.0f}s ({phase}) ===",
            file=err,
            flush=True,
        )
        print("--- Python stacks of every thread:", file=err, flush=True)
        print(thread_stacks(), file=err, flush=True)
        if self.mount_metrics:
            print(
                f"--- lakecache mount in-flight operations ({self.mount_metrics}):\n"
                + fetch_inflight(self.mount_metrics),
                file=err,
                flush=True,
            )
        ckpt = self.last_checkpoint() or "none (no checkpoint saved or resumed yet)"
        print(
            f"lakecache-train: stuck: rank {self.rank} made no progress for {idle:.0f}s "
            f"while {phase} (last completed step {step}); last good checkpoint: {ckpt}; "
            f"exiting with code {EXIT_STUCK}",
            file=err,
            flush=True,
        )
        self._exit(EXIT_STUCK)
