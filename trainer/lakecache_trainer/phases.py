"""Where a run's time goes: data wait, forward+backward, optimizer,
checkpoint. On a GPU the compute phases are timed with CUDA events read
after the step's one synchronize, so timing adds no host syncs.
"""

from __future__ import annotations

import time

import torch

PHASES = ("data_wait", "forward_backward", "optimizer", "checkpoint")


class PhaseClock:
    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.total = dict.fromkeys(PHASES, 0.0)
        self.step = dict.fromkeys(PHASES, 0.0)
        self._events: list[tuple[str, object, object]] = []
        self._open: tuple[str, object] | None = None

    def begin_step(self) -> None:
        self.step = dict.fromkeys(PHASES, 0.0)
        self._events.clear()

    def add(self, phase: str, seconds: float) -> None:
        self.step[phase] += seconds
        self.total[phase] += seconds

    def start(self, phase: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._open = (phase, ev)
        else:
            self._open = (phase, time.perf_counter())

    def stop(self) -> None:
        assert self._open is not None
        phase, begin = self._open
        self._open = None
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((phase, begin, end))
        else:
            self.add(phase, time.perf_counter() - begin)  # type: ignore[operator]

    def end_step(self) -> None:
        """After the step's synchronize: folds the CUDA timings in."""
        for phase, begin, end in self._events:
            self.add(phase, begin.elapsed_time(end) / 1000.0)  # type: ignore[attr-defined]
        self._events.clear()

    def summary(self, wall: float) -> dict:
        out = {f"{k}_s": round(v, 4) for k, v in self.total.items()}
        accounted = sum(self.total.values())
        out["other_s"] = round(max(0.0, wall - accounted), 4)
        out["wall_s"] = round(wall, 4)
        out["fractions"] = {
            k: round(v / wall, 4) if wall > 0 else 0.0
            for k, v in {**self.total, "other": max(0.0, wall - accounted)}.items()
        }
        return out

    @staticmethod
    def table(summary: dict) -> str:
        rows = [
            ("data wait", "data_wait"),
            ("forward+backward", "forward_backward"),
            ("optimizer", "optimizer"),
            ("checkpoint", "checkpoint"),
            ("other", "other"),
        ]
        lines = [f"time breakdown over {summary['wall_s']:.1f}s of training:"]
        for label, key in rows:
            secs = summary[f"{key}_s"]
            lines.append(f"  {label:<17} {secs:9.2f}s  {100 * summary['fractions'][key]:5.1f}%")
        return "\n".join(lines)
