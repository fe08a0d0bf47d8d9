"""Plots plan-epochs.json (written by the plan-epochs bench): hit ratio and
data wait per step, for each reader and rank count, both epochs in a row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

READERS = {
    "plans": "workers, plans",
    "mounts": "mounts, plans",
    "mounts-random": "mounts, plans, random advice",
    "lru": "workers, LRU",
    "nocache": "no cache (S3)",
}


def plot(doc: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted({row["ranks"] for row in doc["rows"]})
    # Mounts alone have no per-step hits (their ratio is per epoch, in
    # the table): then the wait row alone.
    with_hits = any(
        s[0] is not None for epochs in doc["steps"].values() for epoch in epochs for s in epoch
    )
    rows = 2 if with_hits else 1
    fig, axes = plt.subplots(
        rows, len(ranks), figsize=(6.5 * len(ranks), 3.5 * rows + 0.5), squeeze=False
    )
    for col, r in enumerate(ranks):
        hit_ax, wait_ax = (axes[0][col], axes[1][col]) if with_hits else (None, axes[0][col])
        for key, label in READERS.items():
            epochs = doc["steps"].get(f"{key}-{r}")
            if not epochs:
                continue
            steps = [s for epoch in epochs for s in epoch]
            xs = range(1, len(steps) + 1)
            # None: no per-read hit (a mount's reads; its epoch ratio is
            # in the table).
            hits = [float("nan") if s[0] is None else s[0] for s in steps]
            if hit_ax is not None:
                hit_ax.plot(xs, hits, label=label, linewidth=1)
            wait_ax.plot(xs, [s[1] for s in steps], label=label, linewidth=1)
            boundary = len(epochs[0]) + 0.5
        for ax in (hit_ax, wait_ax):
            if ax is None:
                continue
            ax.axvline(boundary, color="grey", linestyle=":", linewidth=1)
            ax.set_xlabel("step (epoch 1, then epoch 2)")
        if hit_ax is not None:
            hit_ax.set_title(f"{r} rank(s): hit ratio per step")
            hit_ax.set_ylim(-0.02, 1.02)
            hit_ax.legend(loc="lower right", fontsize="small")
        else:
            wait_ax.legend(loc="upper right", fontsize="small")
        wait_ax.set_title(f"{r} rank(s): data wait per step (ms)")
        wait_ax.set_yscale("symlog", linthresh=1)
        wait_ax.set_ylim(bottom=0)
    fig.suptitle(
        f"Two shuffled epochs, cache half the data set, {doc['rtt_ms']} ms RTT, "
        f"{doc['compute_ms']} ms compute per step"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("benches/results/plan-epochs.json")
    doc = json.loads(src.read_text())
    out = src.with_suffix(".png")
    plot(doc, out)
    print(f"plot: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
