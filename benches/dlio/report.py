"""The DLIO bench's tables (markdown, printed and written), its plot of
AU against emulated accelerators, and its plot of AU epoch by epoch."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "fio"))

import provenance  # noqa: E402


def _f(v, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def _pct(v) -> str:
    return "-" if v is None else f"{v:.1f}%"


def _au(r: dict) -> float:
    return r["warm_au"] if r["warm_au"] is not None else r["cold_au"]


def median_rows(rows: list[dict]) -> list[dict]:
    """One row per (workload, reader, RTT, accelerators), whose AU is the
    median over the rounds that ran it (rows of one round pass as they
    are)."""
    import statistics

    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if "skipped" not in r:
            groups.setdefault((r["workload"], r["reader"], r["rtt"], r["np"]), []).append(r)
    out = []
    for rs in groups.values():
        if len(rs) == 1:
            out.append(rs[0])
            continue
        out.append({**rs[0], "warm_au": statistics.median(_au(r) for r in rs), "cold_au": 0.0})
    return out


def rounds_lines(rows: list[dict]) -> list[str]:
    """Warm AU round by round, each reader's median, and its difference
    to local disk at the same accelerator count in the same round (the
    machine's state shared by the pair cancels out of it)."""
    import statistics

    ran = [r for r in rows if "skipped" not in r]
    if len({r.get("round", 0) for r in ran}) < 2:
        return []
    local = {(r.get("round", 0), r["np"]): _au(r) for r in ran if r["reader"] == "local"}
    groups: dict[tuple, list[dict]] = {}
    for r in ran:
        groups.setdefault((r["reader"], r["rtt"], r["np"]), []).append(r)
    lines = [
        "Warm AU by round (the readers interleaved, their order reversed every other "
        "round), the median, and the difference to local disk in the same round "
        "(median, and each round's):",
        "",
        "| reader | RTT | accel. | warm AU by round | median | vs local (median) | "
        "vs local by round |",
        "|---|---|---|---|---|---|---|",
    ]
    for (reader, rtt, np_), rs in groups.items():
        rs.sort(key=lambda r: r.get("round", 0))
        aus = [_au(r) for r in rs]
        diffs = [
            _au(r) - local[(r.get("round", 0), np_)]
            for r in rs
            if reader != "local" and (r.get("round", 0), np_) in local
        ]
        lines.append(
            f"| {reader} | {rtt} ms | {np_} | {', '.join(f'{x:.1f}' for x in aus)} | "
            f"{statistics.median(aus):.1f}% | "
            + (f"{statistics.median(diffs):+.1f} | " if diffs else "- | ")
            + (", ".join(f"{d:+.1f}" for d in diffs) if diffs else "-")
            + " |"
        )
    return [*lines, ""]


def epoch_time_lines(rows: list[dict]) -> list[str]:
    """Warm epochs' wall time round by round, and how much longer than
    local disk's in the same round. DLIO's AU leaves out each epoch's
    first step, where the loader fills its queue, so two readers whose
    epochs last alike can differ by many AU points (the one whose waits
    fall after the first step looks worse); this table counts every
    wait. Also from the third epoch on, past the first warm epoch (slow
    through the tier on this VM for reasons of its own: see
    `first-warm-pass-1206.md`)."""
    import statistics

    def mean_from(r: dict, first: int) -> float | None:
        secs = r.get("epoch_s") or []
        return statistics.fmean(secs[first:]) if len(secs) > first else None

    ran = [r for r in rows if "skipped" not in r and mean_from(r, 1)]
    if len({r.get("round", 0) for r in ran}) < 2:
        return []
    local = {(r.get("round", 0), r["np"]): r for r in ran if r["reader"] == "local"}
    groups: dict[tuple, list[dict]] = {}
    for r in ran:
        groups.setdefault((r["reader"], r["rtt"], r["np"]), []).append(r)

    def longer(rs: list[dict], first: int) -> list[float]:
        out = []
        for r in rs:
            base = local.get((r.get("round", 0), r["np"]))
            mine, theirs = mean_from(r, first), base and mean_from(base, first)
            if r["reader"] != "local" and mine and theirs:
                out.append(100.0 * (mine / theirs - 1.0))
        return out

    lines = [
        "Warm epochs' wall time (every step's wait counted) by round, and how much"
        " longer than local disk's in the same round (median, and each round's): the"
        " mean of epochs 2 on, and of epochs 3 on:",
        "",
        "| reader | RTT | accel. | warm epoch s by round | median | vs local (median) |"
        " epochs 3 on: s by round | vs local (median) | vs local by round |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def pct(v: list[float]) -> str:
        return f"{statistics.median(v):+.1f}%" if v else "-"

    for (reader, rtt, np_), rs in groups.items():
        rs.sort(key=lambda r: r.get("round", 0))
        warm = [mean_from(r, 1) or 0.0 for r in rs]
        steady = [s for s in (mean_from(r, 2) for r in rs) if s is not None]
        later = longer(rs, 2)
        lines.append(
            f"| {reader} | {rtt} ms | {np_} | {', '.join(f'{x:.2f}' for x in warm)} | "
            f"{statistics.median(warm):.2f} s | {pct(longer(rs, 1))} | "
            f"{', '.join(f'{x:.2f}' for x in steady) or '-'} | {pct(later)} | "
            + (", ".join(f"{d:+.1f}%" for d in later) if later else "-")
            + " |"
        )
    return [*lines, ""]


def best_count(rows: list[dict]) -> int | None:
    """The largest accelerator count whose warm AU (cold with one epoch)
    is 90% or more, among counts run in order from 1."""
    best = None
    for r in sorted(median_rows(rows), key=lambda r: r["np"]):
        if _au(r) < 90:
            break
        best = r["np"]
    return best


def write(
    a: argparse.Namespace, rows: list[dict], scale: dict, s3fs: str | None, ckpt: list[dict]
) -> None:
    lines = [
        "# DLIO (MLPerf Storage) through lakecache, local disk and s3fs",
        "",
        *provenance.header(),
        "",
        "Scaled runs on this machine, **not MLPerf Storage submissions**: the datasets are "
        "far smaller than MLPerf's rules ask (several times host memory), and the emulated "
        "compute time is scaled as below. The DLIO processes run in a memory cgroup whose "
        "limit is 1.5 times the memory a DLIO process was seen to hold itself (measured in "
        f"the first calibration run), per process (twice that for the Python client, whose "
        "processes fill no page cache and slowed by reclaim at 1x), plus "
        f"{a.page_cache} of page cache; the "
        "lakecache worker and mount (with a 512 MiB `--memory-limit`), or s3fs, in another "
        "of 1.5 GiB in all, so warm epochs are served by "
        "the storage, not by RAM. Every run starts cold: "
        "caches emptied and the page cache dropped; epoch 1 is **cold**, the mean of the "
        f"later epochs (of {a.epochs}) is **warm**, and the last epoch's AU is shown too "
        "(the steady state of a longer run).",
        "",
        "- AU: DLIO's accelerator utilisation (compute / (compute + data wait)).",
        "- read MiB/s: bytes the DLIO processes read (rchar of every process in their "
        "cgroup) over the training time; DLIO's own MB/s is samples x nominal size.",
        "- wait/step: the data wait per step that AU implies at the scaled compute time.",
        "- CPU-s/GiB: user + system CPU of the serving daemons (lakecache's worker and "
        "mount, or s3fs) per GiB the readers read; the S3 endpoint and the delay proxy "
        "stand for the data lake and are left out.",
        f"- s3fs: {s3fs or 'not run'}, with its local cache (`use_cache`).",
        f"- {getattr(a, 'page_reporting_note', 'free page reporting: not recorded')}.",
        "- the S3 endpoint: "
        + (
            f"in a memory cgroup of {a.endpoint_memory} (its page cache included)."
            if getattr(a, "endpoint_memory", None)
            else "no memory limit (the bucket's files it reads stay in the page cache)."
        ),
        "",
    ]
    for name, (compute, factor, batch, dlio_batch) in scale.items():
        lines.append(
            f"- {name}: steps of {batch} samples (DLIO's config: {dlio_batch}), emulated "
            f"compute {compute} s per step, **{factor:.2f}x** DLIO's H100 figure per sample, "
            "chosen so local disk reaches about 90% AU with one accelerator here "
            + (
                "(given with --compute)."
                if name in getattr(a, "fixed_compute", {})
                else "(searched from 0.9 of a warm step's length with no compute, at most "
                f"{a.search_runs} local runs)."
            )
        )
    lines.append("")
    workloads = sorted({r["workload"] for r in rows})
    for wl in workloads:
        lines += [
            f"## {wl}",
            "",
            "| reader | RTT | accel. | AU cold | AU warm | AU last | samples/s cold | "
            "samples/s warm | read MiB/s | wait/step cold | wait/step warm | "
            "CPU-s/GiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            if r["workload"] != wl:
                continue
            if "skipped" in r:
                lines.append(
                    f"| {r['reader']} | {r['rtt']} ms | - | skipped: {r['skipped']} "
                    "| | | | | | | | |"
                )
                continue
            reader = r["reader"] + (f" (round {r['round'] + 1})" if a.rounds > 1 else "")
            lines.append(
                f"| {reader} | {r['rtt']} ms | {r['np']} | {_pct(r['cold_au'])} | "
                f"{_pct(r['warm_au'])} | {_pct(r.get('last_au'))} | {r['cold_samples_s']:.2f} | "
                f"{_f(r['warm_samples_s'], '.2f')} | {r['mib_s']:.0f} | "
                f"{r['cold_wait_s']:.3f} s | {_f(r['warm_wait_s'], '.3f')} s | "
                f"{_f(r['cpu_per_gib'], '.2f')} |"
            )
        lines += [
            "",
            *rounds_lines([r for r in rows if r["workload"] == wl]),
            *epoch_time_lines([r for r in rows if r["workload"] == wl]),
            "Largest accelerator count with AU >= 90% (warm; the median over rounds), "
            "within the sweep "
            f"(1 to {a.max_accelerators}, stopping at the first count below 90%):",
            "",
        ]
        groups: dict[tuple, list[dict]] = {}
        for r in rows:
            if r["workload"] == wl and "skipped" not in r:
                groups.setdefault((r["reader"], r["rtt"]), []).append(r)
        for (reader, rtt), rs in groups.items():
            lines.append(f"- {reader} at {rtt} ms: {best_count(rs) or 'none'}")
        lines.append("")
        lines += epoch_lines([r for r in rows if r["workload"] == wl and "epoch_au" in r], a.rounds)
    lines += checkpoint_lines(ckpt)
    png = plot(a, rows)
    if png:
        lines.append(f"Plot: `{png.name}` (warm AU against emulated accelerators).")
    png = plot_epochs(a, rows)
    if png:
        lines.append(
            f"Plot: `{png.name}` (AU epoch by epoch at the fewest accelerators run,"
            " the median over rounds)."
        )
    provenance.write(a.out, lines)


def epoch_lines(rows: list[dict], rounds: int = 1) -> list[str]:
    """AU epoch by epoch (one short stall moves an epoch's AU a lot here),
    and what the mount's tier held after the run."""
    if not rows:
        return []
    lines = ["AU by epoch (the first is cold), and the node-local tier after the run:", ""]
    for r in rows:
        au = ", ".join(f"{x:.1f}" for x in r["epoch_au"])
        rnd = f" round {r['round'] + 1}" if rounds > 1 else ""
        line = f"- {r['reader']} {r['rtt']} ms x{r['np']}{rnd}: {au}"
        t = r.get("tier")
        if t:
            mib = 1 << 20
            line += (
                f"; tier: {t['whole']} whole, {t['partial']} partial, fills dropped "
                f"{t['fill_dropped_bytes'] / mib:.0f} MiB, fills its readers waited for "
                f"{t.get('fill_waited_bytes', 0) / mib:.0f} MiB, fetched by completion "
                f"{t['completion_fetched_bytes'] / mib:.0f} MiB"
            )
        lines.append(line)
    lines.append("")
    return lines


def epoch_medians(rows: list[dict]) -> dict[tuple[str, str], list[float]]:
    """AU epoch by epoch for each (workload, "reader RTT"), at the fewest
    accelerators that reader ran: the median over its rounds, epoch by
    epoch (rounds of unequal length are cut to the shortest)."""
    import statistics

    ran = [r for r in rows if "skipped" not in r and r.get("epoch_au")]
    fewest: dict[tuple, int] = {}
    for r in ran:
        key = (r["workload"], f"{r['reader']} {r['rtt']} ms")
        fewest[key] = min(fewest.get(key, r["np"]), r["np"])
    runs: dict[tuple, list[list[float]]] = {}
    for r in ran:
        key = (r["workload"], f"{r['reader']} {r['rtt']} ms")
        if r["np"] == fewest[key]:
            runs.setdefault(key, []).append(r["epoch_au"])
    out = {}
    for key, series in runs.items():
        n = min(len(s) for s in series)
        out[key] = [statistics.median(s[i] for s in series) for i in range(n)]
    return out


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", flush=True)
        return None
    return plt


def plot_epochs(a: argparse.Namespace, rows: list[dict]) -> Path | None:
    medians = epoch_medians(rows)
    plt = _pyplot() if medians else None
    if plt is None:
        return None
    workloads = sorted({wl for wl, _ in medians})
    fig, axes = plt.subplots(1, len(workloads), figsize=(7 * len(workloads), 4), squeeze=False)
    for ax, wl in zip(axes[0], workloads, strict=True):
        for (w, label), au in sorted(medians.items()):
            if w == wl:
                ax.plot(range(1, len(au) + 1), au, label=label, **series_style(label))
        _au_axes(ax, f"{wl}: AU by epoch (epoch 1 cold)", "epoch")
    return _save(fig, a, "epochs")


def plot(a: argparse.Namespace, rows: list[dict]) -> Path | None:
    plt = _pyplot()
    if plt is None:
        return None
    workloads = sorted({r["workload"] for r in rows if "skipped" not in r})
    if not workloads:
        return None
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
    for ax, wl in zip(axes[0], workloads, strict=True):
        series: dict[str, list[tuple[int, float]]] = {}
        for r in median_rows(rows):
            if r["workload"] != wl:
                continue
            series.setdefault(f"{r['reader']} {r['rtt']} ms", []).append((r["np"], _au(r)))
        for label, pts in sorted(series.items()):
            pts.sort()
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            ax.plot(xs, ys, label=label, **series_style(label))
        ax.set_xticks(range(1, a.max_accelerators + 1))
        _au_axes(ax, f"{wl}: warm AU", "emulated accelerators")
    return _save(fig, a, "au")


# Matplotlib's default cycle has 10 colours and the full matrix has 13
# series, so colours repeated (local 0 ms and pyclient-tier 10 ms looked
# alike): each reader keeps one colour, each RTT its line and marker.
READER_COLOURS = {
    "local": "black",
    "mount-workers": "tab:brown",
    "mount-tier": "tab:blue",
    "mount-tier-whole": "tab:purple",
    "pyclient": "tab:olive",
    "pyclient-tier": "tab:green",
    "s3fs": "tab:red",
}
RTT_STYLES = {"0": ("-", "o"), "10": ("--", "s")}


def series_style(label: str) -> dict:
    """Plot style for a series labelled "reader RTT ms": colour by reader,
    line and marker by RTT (unknown ones get matplotlib's defaults)."""
    reader, _, rest = label.partition(" ")
    linestyle, marker = RTT_STYLES.get(rest.split(" ")[0], (":", "^"))
    style = {"linestyle": linestyle, "marker": marker}
    if reader in READER_COLOURS:
        style["color"] = READER_COLOURS[reader]
    return style


def _au_axes(ax, title: str, xlabel: str) -> None:
    """An AU axis from 0 to 100% with the 90% line the targets use."""
    ax.axhline(90, color="grey", linestyle=":", linewidth=1)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("AU %")
    ax.set_ylim(0, 102)
    ax.legend(fontsize=7)


def _save(fig, a: argparse.Namespace, suffix: str) -> Path:
    """Writes `fig` beside the report, as <report>-<suffix>.png."""
    png = Path(a.out).with_name(f"{Path(a.out).stem}-{suffix}.png")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return png


def checkpoint_lines(ckpt: list[dict]) -> list[str]:
    """Per target: the median over rounds of the total checkpoint time per
    run, and its ratio to local disk in the same round."""
    if not ckpt:
        return []
    import statistics

    failed = [r for r in ckpt if "failed" in r]
    ckpt = [r for r in ckpt if "failed" not in r]
    failed_lines = [f"- failed: {r['target']} round {r['round']}: {r['failed']}" for r in failed]
    if not ckpt:
        return ["## megatron_deepspeed checkpoints (scaled model)", "", *failed_lines, ""]
    by_round: dict[int, dict[str, float]] = {}
    for r in ckpt:
        by_round.setdefault(r["round"], {})[r["target"]] = sum(r["ckpt_s"])
    size = next((r["bytes"] for r in ckpt if r.get("bytes")), None)
    out = [
        "## megatron_deepspeed checkpoints (scaled model)",
        "",
        f"{len(by_round)} round(s), each target once per round; a run writes "
        f"{len(ckpt[0]['ckpt_s'])} checkpoints"
        + (f" of {size / len(ckpt[0]['ckpt_s']) / 2**20:.0f} MiB each" if size else "")
        + ". Time is DLIO's own per-checkpoint duration (its `ckptN` in "
        "per_epoch_stats.json), summed per run; the ratio is against local disk in "
        "the same round, median over rounds.",
        "",
    ]
    durable = any("local-fsync" in rnd for rnd in by_round.values())
    if durable:
        out += [
            "`local-fsync` is local disk with each checkpoint file fsynced before it is "
            "closed, as write-back's close waits for the worker to sync it; DLIO alone "
            "never syncs a checkpoint.",
            "",
        ]
    out += [
        "| target | checkpoint time per run (median, range) | vs local disk |"
        + (" vs local-fsync |" if durable else ""),
        "|---|---|---|" + ("---|" if durable else ""),
    ]

    def ratio_to(t: str, base: str) -> str:
        ratios = [rnd[t] / rnd[base] for rnd in by_round.values() if t in rnd and rnd.get(base)]
        return f"{statistics.median(ratios):.2f}x" if ratios else "-"

    order = {"local": 0, "local-fsync": 1}
    targets = sorted(
        {t for rnd in by_round.values() for t in rnd}, key=lambda t: (order.get(t, 2), t)
    )
    for t in targets:
        times = [rnd[t] for rnd in by_round.values() if t in rnd]
        out.append(
            f"| {t} | {statistics.median(times):.2f} s ({min(times):.2f}-"
            f"{max(times):.2f}) | {ratio_to(t, 'local')} |"
            + (f" {ratio_to(t, 'local-fsync')} |" if durable else "")
        )
    if failed_lines:
        out += ["", *failed_lines]
    return [*out, ""]
