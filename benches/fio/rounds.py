"""Comparisons from interleaved rounds (issue #30).

Every case of a comparison, the baseline included, runs once per round, and
rounds alternate their order, so drift on the machine (a neighbour's load,
the page cache, the disk's own state) falls on every case alike instead of
on whichever ran last. A table cell is the median over the rounds with the
spread (lowest-highest) beside it; a ratio is the median of the per-round
ratios, each taken against the baseline measured in that same round.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence

# A case: its name and a function that measures once and returns
# {column: result}, where a result is a dict of numbers (fio's mib_s, iops...).
Case = tuple[str, Callable[[], dict[str, dict]]]


def add_args(ap: argparse.ArgumentParser, default: int = 3) -> None:
    ap.add_argument(
        "--rounds",
        type=int,
        default=default,
        help=f"interleaved rounds per comparison (median and spread; default {default})",
    )


def check(rounds: int) -> int:
    if rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {rounds}")
    return rounds


def interleave(rounds: int, cases: Sequence[Case], tag: str = "") -> dict[str, list[dict]]:
    """Runs every case once per round, odd rounds in reverse order; returns
    each column's results, one per round, in round order."""
    check(rounds)
    out: dict[str, list[dict]] = {}
    for r in range(rounds):
        order = list(cases) if r % 2 == 0 else list(reversed(cases))
        for _, measure in order:
            for column, result in measure().items():
                out.setdefault(column, []).append(result)
                shown = ", ".join(
                    f"{k}={v:.1f}" for k, v in result.items() if isinstance(v, (int, float))
                )
                print(f"[{tag} round {r + 1}/{rounds}] {column}: {shown}", flush=True)
    return out


def values(samples: Sequence[dict], key: str) -> list[float]:
    got = [s[key] for s in samples if key in s]
    if len(got) != len(samples):
        raise SystemExit(f"a round has no {key!r}: {samples}")
    return got


def median(samples: Sequence[dict], key: str) -> float:
    return statistics.median(values(samples, key))


def _num(v: float) -> str:
    return f"{v:.2f}" if abs(v) < 10 else f"{v:.0f}"


def cpu_key(key: str) -> str:
    """Where a result keeps the CPU-s/GiB of its `key` (cpu.measured adds
    `cpu_per_gib` to fio-shaped results; others name it per figure)."""
    return "cpu_per_gib" if key in ("mib_s", "iops") else f"{key}_cpu_per_gib"


def cell(samples: Sequence[dict], key: str) -> str:
    """`median (lowest-highest)`, then the median CPU-s/GiB when the rounds
    measured it (in every round, or this fails); one round is shown alone."""
    vs = values(samples, key)
    if len(vs) == 1:
        text = _num(vs[0])
    else:
        text = f"{_num(statistics.median(vs))} ({_num(min(vs))}-{_num(max(vs))})"
    if any(cpu_key(key) in s for s in samples):
        text += f"; {statistics.median(values(samples, cpu_key(key))):.2f} CPU-s/GiB"
    return text


def ratio_cell(samples: Sequence[dict], baseline: Sequence[dict], key: str) -> str:
    """Median of the per-round ratios to the baseline, with their spread."""
    vs, bs = values(samples, key), values(baseline, key)
    if len(vs) != len(bs):
        raise SystemExit(f"{len(vs)} rounds against a baseline of {len(bs)}")
    ratios = [v / b if b else float("nan") for v, b in zip(vs, bs, strict=True)]
    if len(ratios) == 1:
        return f"{ratios[0]:.2f}"
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
