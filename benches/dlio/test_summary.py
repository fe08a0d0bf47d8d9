"""The DLIO bench's summary parsing, on a summary a real DLIO 2.0.0 run
wrote (UNet3D, one accelerator, two epochs, local disk), and the opt-in
smoke run (LAKECACHE_DLIO=1: DLIO's venv is several GB)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import summary  # noqa: E402

STORED = HERE / "testdata" / "summary-unet3d-local.json"


def test_a_stored_summary_gives_cold_and_warm_epochs() -> None:
    run = summary.load(STORED)
    assert run.accelerators == 1
    assert len(run.au) == 2
    assert run.cold_au == pytest.approx(98.1797, abs=1e-3)
    assert run.warm_au == pytest.approx(98.2889, abs=1e-3)
    assert run.last_au == run.warm_au
    assert run.cold_samples_s == pytest.approx(3.5363, abs=1e-3)
    assert run.warm_samples_s == pytest.approx(7.9471, abs=1e-3)


def test_one_epoch_has_no_warm_figure() -> None:
    doc = json.loads(STORED.read_text())
    doc["metric"]["train_au_percentage"] = [50.0]
    doc["metric"]["train_throughput_samples_per_second"] = [2.0]
    run = summary.parse(json.dumps(doc))
    assert run.warm_au is None and run.warm_samples_s is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("metric"), "train_au_percentage"),
        (lambda d: d["metric"].pop("train_au_percentage"), "train_au_percentage"),
        (
            lambda d: d["metric"].update(train_throughput_samples_per_second=[1.0]),
            "2 AU values but 1 throughput",
        ),
        (lambda d: d["metric"].update(train_au_percentage=[120.0, 5.0]), "outside 0-100"),
        (lambda d: d["metric"].update(train_au_percentage=["x", 5.0]), "holds 'x'"),
        (lambda d: d.update(num_accelerators=0), "num_accelerators"),
    ],
)
def test_a_broken_summary_is_an_error_naming_the_field(change, message) -> None:
    doc = json.loads(STORED.read_text())
    change(doc)
    with pytest.raises(summary.SummaryError, match=message):
        summary.parse(json.dumps(doc), "s.json")


def test_text_that_is_not_json_is_an_error() -> None:
    with pytest.raises(summary.SummaryError, match="not JSON"):
        summary.parse("[METRIC] AU 98%", "s.json")


def test_data_wait_follows_from_au_and_compute_time() -> None:
    assert summary.data_wait_s(100.0, 0.5) == 0.0
    assert summary.data_wait_s(50.0, 0.5) == pytest.approx(0.5)
    assert summary.data_wait_s(0.0, 0.5) == float("inf")


def test_the_report_lists_au_by_epoch_and_the_tier_after_the_run() -> None:
    import report

    tier = {
        "whole": 14,
        "partial": 0,
        "fill_dropped_bytes": 0,
        "fill_waited_bytes": 1110 << 20,
        "completion_fetched_bytes": 3 << 20,
    }
    rows = [
        {"reader": "local", "rtt": 0, "np": 1, "epoch_au": [96.8, 71.9]},
        {"reader": "mount-tier-whole", "rtt": 10, "np": 2, "epoch_au": [14.5, 97.4], "tier": tier},
    ]
    lines = report.epoch_lines(rows)
    assert "- local 0 ms x1: 96.8, 71.9" in lines
    assert (
        "- mount-tier-whole 10 ms x2: 14.5, 97.4; tier: 14 whole, 0 partial, fills dropped "
        "0 MiB, fills its readers waited for 1110 MiB, fetched by completion 3 MiB"
    ) in lines
    assert report.epoch_lines([]) == []


def run_bench_refusal(*args: str) -> subprocess.CompletedProcess[str]:
    """The bench run by the test venv's python (no DLIO beside it), with
    that python standing in for the lakecache binary: it must refuse."""
    return subprocess.run(
        [sys.executable, str(HERE / "dlio_bench.py"), "--bin", sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="the bench's first check asks for root")
def test_a_python_without_dlio_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """Run with a python that has no DLIO beside it (the test venv's), the
    bench says so and how to run it, and starts nothing."""
    work = tmp_path / "work"
    out = run_bench_refusal("--work", str(work))
    assert out.returncode != 0, out.stdout + out.stderr
    assert "DLIO is not installed beside this python" in out.stderr, out.stderr
    assert "benches/dlio/run.sh" in out.stderr, out.stderr
    assert not work.exists(), "the bench created its work directory before refusing"


@pytest.mark.skipif(os.geteuid() != 0, reason="the bench's first check asks for root")
def test_an_out_path_in_a_missing_directory_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    """A report path whose directory does not exist is refused at once, not
    after the run (whose report and plots are written at its end)."""
    work = tmp_path / "work"
    report = tmp_path / "missing" / "dlio.md"
    out = run_bench_refusal("--work", str(work), "--out", str(report))
    assert out.returncode != 0, out.stdout + out.stderr
    assert f"{report.parent} is not a writable directory" in out.stderr, out.stderr
    assert not work.exists(), "the bench created its work directory before refusing"


@pytest.mark.skipif(os.geteuid() != 0, reason="the bench's first check asks for root")
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workloads", "unet3d,bert"], "--workloads: unknown bert; known: unet3d, resnet50"),
        (["--workloads", "none", "--no-checkpoints"], "leaves nothing to run"),
        (["--checkpoint-targets", "local,s3"], "--checkpoint-targets: unknown s3; known: local"),
        (["--readers", "local,nfs"], "unknown readers ['nfs']"),
        (["--rtt-ms", "0,ten"], "--rtt-ms '0,ten': want milliseconds"),
    ],
)
def test_unknown_choices_are_refused_naming_what_is_known(
    tmp_path: Path, args: list[str], message: str
) -> None:
    """A workload, checkpoint target, reader or RTT the bench does not know
    is refused before anything is looked for or started."""
    work = tmp_path / "work"
    out = run_bench_refusal("--work", str(work), *args)
    assert out.returncode != 0, out.stdout + out.stderr
    assert message in out.stderr, out.stderr
    assert "DLIO is not installed" not in out.stderr, out.stderr
    assert not work.exists(), "the bench created its work directory before refusing"


@pytest.mark.skipif(
    os.environ.get("LAKECACHE_DLIO") != "1",
    reason="opt-in: LAKECACHE_DLIO=1 installs DLIO (several GB) and runs it through a mount",
)
def test_smoke_dlio_through_a_real_mount(tmp_path: Path) -> None:
    """DLIO's smallest configuration through a real mount: a handful of
    files, one epoch, one process; its summary parsed."""
    binary = os.environ.get("LAKECACHE_BIN", "")
    assert binary, "LAKECACHE_BIN names the lakecache binary"
    # DLIO's own venv (installed on first use, several GB).
    venv = subprocess.run(
        [str(HERE / "install.sh")], capture_output=True, text=True, timeout=3600, check=True
    ).stdout.splitlines()[-1]
    out = subprocess.run(
        [
            f"{venv}/bin/python",
            str(HERE / "dlio_bench.py"),
            "--smoke",
            "--bin",
            binary,
            "--work",
            str(tmp_path / "work"),
            "--out",
            str(tmp_path / "smoke.md"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = (tmp_path / "smoke.md").read_text()
    assert "| mount-workers |" in text, text


def test_a_failed_checkpoint_run_is_listed_and_the_rest_reported() -> None:
    import report

    rows = [
        {"target": "local", "round": 0, "ckpt_s": [1.0, 1.0], "bytes": 2 << 20},
        {"target": "mount-back", "round": 0, "ckpt_s": [1.1, 1.1], "bytes": 2 << 20},
        {"target": "local", "round": 1, "failed": "DLIO failed (exit 1); its log: /x/run.log"},
    ]
    text = "\n".join(report.checkpoint_lines(rows))
    assert "| mount-back | 2.20 s (2.20-2.20) | 1.10x |" in text, text
    assert "- failed: local round 1: DLIO failed (exit 1); its log: /x/run.log" in text, text
    only_failed = "\n".join(report.checkpoint_lines(rows[2:]))
    assert "- failed: local round 1" in only_failed, only_failed


def test_checkpoints_are_also_compared_with_local_disk_that_syncs() -> None:
    import report

    rows = [
        {"target": "mount-back", "round": 0, "ckpt_s": [1.5], "bytes": 1 << 20},
        {"target": "local-fsync", "round": 0, "ckpt_s": [1.2], "bytes": 1 << 20},
        {"target": "local", "round": 0, "ckpt_s": [1.0], "bytes": 1 << 20},
    ]
    lines = report.checkpoint_lines(rows)
    table = [line for line in lines if line.startswith("| ")]
    assert table[1:] == [
        "| local | 1.00 s (1.00-1.00) | 1.00x | 0.83x |",
        "| local-fsync | 1.20 s (1.20-1.20) | 1.20x | 1.00x |",
        "| mount-back | 1.50 s (1.50-1.50) | 1.50x | 1.25x |",
    ], "\n".join(lines)


def test_rounds_give_medians_and_differences_to_local_disk_in_the_same_round() -> None:
    import report

    def row(reader: str, rtt: int, rnd: int, au: float, np_: int = 1) -> dict:
        return {
            "workload": "unet3d",
            "reader": reader,
            "rtt": rtt,
            "np": np_,
            "round": rnd,
            "warm_au": au,
            "cold_au": 30.0,
        }

    rows = [
        row("local", 0, 0, 95.0),
        row("mount-tier", 10, 0, 94.0),
        row("mount-tier", 10, 1, 97.5),
        row("local", 0, 1, 96.0),
        row("local", 0, 2, 91.0),
        row("mount-tier", 10, 2, 89.0),
        {"workload": "unet3d", "reader": "s3fs", "rtt": 10, "np": 1, "skipped": "failed"},
    ]
    lines = report.rounds_lines(rows)
    assert "| local | 0 ms | 1 | 95.0, 96.0, 91.0 | 95.0% | - | - |" in lines
    # Differences -1.0, +1.5, -2.0: the median is -1.0.
    want = "| mount-tier | 10 ms | 1 | 94.0, 97.5, 89.0 | 94.0% | -1.0 | -1.0, +1.5, -2.0 |"
    assert want in lines
    # The sweep's count uses the median: 94.0 is at or above 90.
    assert report.best_count([r for r in rows if r["reader"] == "mount-tier"]) == 1
    low = [row("mount-tier", 10, i, au) for i, au in enumerate((95.0, 80.0, 85.0))]
    assert report.best_count(low) is None
    # One round: nothing to add.
    assert report.rounds_lines([row("local", 0, 0, 95.0), row("mount-tier", 10, 0, 94.0)]) == []


def test_epoch_times_come_from_per_epoch_stats_and_a_broken_one_is_named() -> None:
    stats = (HERE / "testdata" / "per-epoch-stats-unet3d-local.json").read_text()
    secs = summary.epoch_seconds(stats)
    assert len(secs) == 8
    assert secs[:3] == pytest.approx([3.84, 1.64, 2.05])
    doc = json.loads(stats)
    del doc["3"]["duration"]
    with pytest.raises(summary.SummaryError, match="epoch 3 has no duration"):
        summary.epoch_seconds(json.dumps(doc))
    doc["3"]["duration"] = "soon"
    with pytest.raises(summary.SummaryError, match="epoch 3 lasted 'soon'"):
        summary.epoch_seconds(json.dumps(doc))
    with pytest.raises(summary.SummaryError, match="no epochs"):
        summary.epoch_seconds("{}")


def test_epoch_times_by_round_give_how_much_longer_than_local_disk() -> None:
    import report

    def row(reader: str, rnd: int, secs: list[float]) -> dict:
        return {"reader": reader, "rtt": 0, "np": 1, "round": rnd, "epoch_s": secs}

    rows = [row("local", 0, [9.0, 2.0, 2.0]), row("mount-tier", 0, [20.0, 3.0, 2.2])]
    rows += [row("local", 1, [9.0, 1.5, 1.7]), row("mount-tier", 1, [20.0, 1.6, 1.6])]
    rows += [row("mount-tier", 2, [20.0, 3.0, 3.0])]
    lines = report.epoch_time_lines(rows)
    assert "| local | 0 ms | 1 | 2.00, 1.60 | 1.80 s | - | 2.00, 1.70 | - | - |" in lines, lines
    # Epochs 2 on: 2.6 against 2.0 (+30%) and 1.6 against 1.6; epochs 3 on:
    # 2.2 against 2.0 (+10%) and 1.6 against 1.7 (-5.9%). Round 2 has no
    # local run to compare with.
    want = (
        "| mount-tier | 0 ms | 1 | 2.60, 1.60, 3.00 | 2.60 s | +15.0% | 2.20, 1.60, 3.00 |"
        " +2.1% | +10.0%, -5.9% |"
    )
    assert want in lines, lines
    # Rows without epoch times (kept from before), or one round: no table.
    assert report.epoch_time_lines([row("local", 0, []), row("local", 1, [])]) == []
    assert report.epoch_time_lines(rows[:2]) == []


def test_epoch_medians_take_each_epoch_over_rounds_at_the_fewest_accelerators() -> None:
    import report

    def row(reader: str, np_: int, au: list[float], rnd: int = 0) -> dict:
        return {
            "workload": "unet3d",
            "reader": reader,
            "rtt": 10,
            "np": np_,
            "round": rnd,
            "epoch_au": au,
        }

    rows = [
        row("mount-tier", 1, [20.0, 60.0, 95.0], 0),
        row("mount-tier", 1, [30.0, 80.0, 97.0, 99.0], 1),
        row("mount-tier", 1, [25.0, 70.0, 90.0], 2),
        row("mount-tier", 2, [10.0, 10.0, 10.0]),
        {"workload": "unet3d", "reader": "s3fs", "rtt": 10, "np": 1, "skipped": "failed"},
    ]
    medians = report.epoch_medians(rows)
    # Cut to the shortest round (3 epochs); the 2-accelerator run is left out.
    assert medians == {("unet3d", "mount-tier 10 ms"): [25.0, 70.0, 95.0]}
    assert report.epoch_medians([rows[-1]]) == {}


def test_every_reader_and_rtt_of_the_matrix_plots_in_a_style_of_its_own() -> None:
    import dlio_bench
    import report

    styles = [
        tuple(sorted(report.series_style(f"{reader} {rtt} ms").items()))
        for reader in dlio_bench.READERS
        for rtt in (0, 10)
    ]
    assert len(set(styles)) == len(styles)
    # The epoch plot's labels name the same series.
    assert report.series_style("s3fs 10 ms") == report.series_style("s3fs 10 ms x2")
