"""Free page reporting (virtio-balloon): a VM hands memory that has been
free a while back to its host, and the next use of it faults in page by
page. On this project's VM that made the first warm DLIO epoch through
the node-local tier slow (first-warm-pass-1206.md): its page cache is
built from blocks freed during the cold epoch and already handed back.
The bench can turn reporting off for its run (and restores it), so the
warm figures describe the storage on a machine that keeps its memory,
as bare metal does."""

from __future__ import annotations

from pathlib import Path

from cgroup import BenchError

PARAMS = Path("/sys/module/page_reporting/parameters")
# Above the buddy allocator's largest order (10 on x86-64): no free block
# qualifies, so nothing is reported.
OFF_ORDER = "11"
# The setting to put back while a run has it off: outside any --work, so
# a run with another --work finds what a killed one left.
SAVED = Path("/var/tmp/lakecache-dlio-page-reporting-order")


class PageReporting:
    """Turns reporting off and back to what it was; a machine without
    it (no `page_reporting` module parameters) has nothing to turn off.
    The value to restore is also kept in `saved_file` until restored, so
    a bench killed with reporting off (kill -9 skips `finally`) has it
    put back by the next run (`recover`)."""

    def __init__(self, params: Path = PARAMS, saved_file: Path | None = None) -> None:
        self.order_file = params / "page_reporting_order"
        self.reported_file = params / "reported_kib"
        self.saved_file = saved_file
        self.saved: str | None = None

    def recover(self) -> str | None:
        """Puts back a setting a killed run left off; returns it."""
        if self.saved_file is None or not self.saved_file.exists():
            return None
        value = self.saved_file.read_text().strip()
        if self.present() and value:
            self.order_file.write_text(value)
        self.saved_file.unlink()
        return value or None

    def present(self) -> bool:
        return self.order_file.exists()

    def turn_off(self) -> None:
        if not self.present():
            return
        try:
            self.saved = self.order_file.read_text().strip()
            if self.saved_file is not None:
                self.saved_file.write_text(self.saved)
            self.order_file.write_text(OFF_ORDER)
        except OSError as e:
            raise BenchError(
                f"cannot turn free page reporting off ({self.order_file}: {e}); run as root, "
                "or leave out --free-page-reporting off"
            ) from e
        if self.order_file.read_text().strip() != OFF_ORDER:
            self.restore()
            raise BenchError(
                f"{self.order_file} did not take {OFF_ORDER}: this kernel cannot turn free "
                "page reporting off this way; leave out --free-page-reporting off"
            )

    def restore(self) -> None:
        if self.saved is not None:
            self.order_file.write_text(self.saved)
            self.saved = None
        if self.saved_file is not None:
            self.saved_file.unlink(missing_ok=True)

    def reported_kib(self) -> int | None:
        """Memory handed back to the host so far, where the kernel says."""
        try:
            return int(self.reported_file.read_text())
        except (OSError, ValueError):
            return None

    def describe(self, off: bool) -> str:
        if not self.present():
            return "free page reporting: not on this machine"
        if off:
            return (
                "free page reporting: **turned off for the run** (`page_reporting_order` "
                f"{OFF_ORDER}, restored after), as on a machine that keeps its free memory"
            )
        return (
            "free page reporting: on (`page_reporting_order` "
            f"{self.order_file.read_text().strip()}): memory free a while is handed back to "
            "the host, and the next pass that uses it pays for it"
        )
