"""The bench's free page reporting switch, on a stand-in parameter
directory (the real one is the kernel's)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cgroup import BenchError  # noqa: E402
from page_reporting import OFF_ORDER, PageReporting  # noqa: E402


def params(tmp_path: Path, order: str = "9") -> Path:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "page_reporting_order").write_text(f"{order}\n")
    (tmp_path / "reported_kib").write_text("1234\n")
    return tmp_path


def test_turned_off_then_restored(tmp_path: Path) -> None:
    pr = PageReporting(params(tmp_path))
    pr.turn_off()
    assert (tmp_path / "page_reporting_order").read_text() == OFF_ORDER
    assert "turned off" in pr.describe(True)
    pr.restore()
    assert (tmp_path / "page_reporting_order").read_text() == "9"
    assert pr.reported_kib() == 1234


def test_a_machine_without_reporting_has_nothing_to_turn_off(tmp_path: Path) -> None:
    pr = PageReporting(tmp_path / "absent")
    pr.turn_off()
    pr.restore()
    assert pr.reported_kib() is None
    assert "not on this machine" in pr.describe(True)


def test_a_value_the_kernel_does_not_keep_is_an_error_and_restores(tmp_path: Path) -> None:
    p = params(tmp_path)
    pr = PageReporting(p)
    # A parameter that reads back something else (a kernel clamping it).
    order = p / "page_reporting_order"
    real_write = Path.write_text

    def clamping(self: Path, text: str, *args, **kwargs) -> int:
        return real_write(self, "10" if self == order and text == OFF_ORDER else text)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Path, "write_text", clamping)
        with pytest.raises(BenchError, match="did not take"):
            pr.turn_off()
    assert order.read_text() == "9"


def test_a_run_killed_with_reporting_off_is_put_back_by_the_next(tmp_path: Path) -> None:
    p = params(tmp_path / "params")
    saved = tmp_path / "work" / "page_reporting_order.saved"
    saved.parent.mkdir()
    killed = PageReporting(p, saved)
    killed.turn_off()
    # No restore(): the process died with reporting off.
    assert (p / "page_reporting_order").read_text() == OFF_ORDER
    assert saved.read_text() == "9"
    next_run = PageReporting(p, saved)
    assert next_run.recover() == "9"
    assert (p / "page_reporting_order").read_text() == "9"
    assert not saved.exists()
    assert next_run.recover() is None
