"""DLIO's `summary.json`, read into what the bench tables show.

DLIO (MLPerf Storage's benchmark) writes one summary per run with, per
training epoch, the accelerator utilisation (AU, %) and samples/s. Its own
MB/s is samples x the nominal record size, not bytes read; the bench
measures bytes separately. The first epoch after emptied caches is the
cold one; the later epochs are warm.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path


class SummaryError(ValueError):
    """A summary DLIO did not finish or that lacks what the bench needs."""


@dataclass(frozen=True)
class Epochs:
    """One run: per-epoch AU (%) and samples/s, in epoch order."""

    accelerators: int
    au: list[float]
    samples_s: list[float]

    @property
    def cold_au(self) -> float:
        return self.au[0]

    @property
    def warm_au(self) -> float | None:
        """Mean AU of the epochs after the first; None with one epoch."""
        return statistics.fmean(self.au[1:]) if len(self.au) > 1 else None

    @property
    def last_au(self) -> float:
        """The last epoch's AU: the steady state a long run settles in."""
        return self.au[-1]

    @property
    def cold_samples_s(self) -> float:
        return self.samples_s[0]

    @property
    def warm_samples_s(self) -> float | None:
        return statistics.fmean(self.samples_s[1:]) if len(self.samples_s) > 1 else None


def parse(text: str, source: str = "summary.json") -> Epochs:
    """Reads one summary; a missing or malformed field is an error naming
    it (a run that died before its end writes no metric)."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise SummaryError(f"{source}: not JSON: {e}") from e
    if not isinstance(doc, dict):
        raise SummaryError(f"{source}: not a JSON object")
    metric = doc.get("metric")
    if not isinstance(metric, dict) or "train_au_percentage" not in metric:
        raise SummaryError(f"{source}: no train_au_percentage (did the training phase finish?)")
    au = _numbers(metric["train_au_percentage"], "train_au_percentage", source)
    samples = _numbers(
        metric.get("train_throughput_samples_per_second"),
        "train_throughput_samples_per_second",
        source,
    )
    if len(au) != len(samples):
        raise SummaryError(f"{source}: {len(au)} AU values but {len(samples)} throughput values")
    if any(not 0 <= a <= 100.0001 for a in au):
        raise SummaryError(f"{source}: AU outside 0-100%: {au}")
    accelerators = doc.get("num_accelerators")
    if not isinstance(accelerators, int) or accelerators < 1:
        raise SummaryError(f"{source}: num_accelerators is {accelerators!r}")
    return Epochs(accelerators=accelerators, au=au, samples_s=samples)


def load(path: Path) -> Epochs:
    try:
        text = path.read_text()
    except OSError as e:
        raise SummaryError(f"{path}: {e}") from e
    return parse(text, str(path))


def epoch_seconds(text: str, source: str = "per_epoch_stats.json") -> list[float]:
    """Each training epoch's wall time in seconds, in epoch order, from
    DLIO's `per_epoch_stats.json`. Unlike AU, which leaves out each
    epoch's first step, it counts every wait, the first batch's too."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise SummaryError(f"{source}: not JSON: {e}") from e
    if not isinstance(doc, dict) or not doc:
        raise SummaryError(f"{source}: no epochs")
    out = []
    for n in range(1, len(doc) + 1):
        epoch = doc.get(str(n))
        if not isinstance(epoch, dict) or "duration" not in epoch:
            raise SummaryError(f"{source}: epoch {n} has no duration")
        try:
            seconds = float(epoch["duration"])
        except (TypeError, ValueError):
            raise SummaryError(f"{source}: epoch {n} lasted {epoch['duration']!r}") from None
        if not seconds > 0:
            raise SummaryError(f"{source}: epoch {n} lasted {seconds} s")
        out.append(seconds)
    return out


def _numbers(value: object, name: str, source: str) -> list[float]:
    if not isinstance(value, list) or not value:
        raise SummaryError(f"{source}: {name} is {value!r}, not a list of numbers")
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise SummaryError(f"{source}: {name} holds {v!r}")
        out.append(float(v))
    return out


def data_wait_s(au_percent: float, compute_s: float) -> float:
    """Seconds per step the emulated accelerator waited for data: DLIO's
    AU is compute / (compute + wait) per step."""
    if au_percent <= 0:
        return float("inf")
    return compute_s * (100.0 / au_percent - 1.0)
