"""Child processes for the Python tests, held to the same rules as the Rust
ones (cli/tests/common): every child writes stdout and stderr to its own
log file, printed when the test that started it fails; children bind port
0 themselves and the test reads the port they report; every deadline is
multiplied by LAKECACHE_TEST_TIME_SCALE (a positive number, default 1).

Put on sys.path by trainer/tests/conftest.py and ops/tests/conftest.py,
which import its two hooks to attach the logs to failing reports."""

from __future__ import annotations

import atexit
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

_LOG_DIR = Path(tempfile.mkdtemp(prefix="lakecache-pytest-logs-"))
_started: list[Child] = []
_scope = ""


def time_scale() -> float:
    raw = os.environ.get("LAKECACHE_TEST_TIME_SCALE")
    if raw is None:
        return 1.0
    try:
        f = float(raw)
    except ValueError:
        f = -1.0
    if not (f > 0 and f != float("inf")):
        raise ValueError(
            f"LAKECACHE_TEST_TIME_SCALE={raw!r} is not a positive number (e.g. 2 or 0.5)"
        )
    return f


def scaled(secs: float) -> float:
    return secs * time_scale()


def wait_for(what: str, ok: Callable[[], bool], secs: float = 30.0, every: float = 0.1) -> None:
    """Polls `ok` until it holds; fails after `secs` (scaled)."""
    deadline = time.monotonic() + scaled(secs)
    while not ok():
        assert time.monotonic() < deadline, (
            f"timed out after {scaled(secs):.0f} s waiting for {what}"
        )
        time.sleep(every)


def port_in(line: str) -> int | None:
    """The port of the last HOST:PORT in `line`."""
    ports = [int(p) for p in re.findall(r":(\d{1,5})\b", line) if 0 < int(p) < 65536]
    return ports[-1] if ports else None


def complete_lines(text: str) -> list[str]:
    """The lines of `text` that end in a newline: a log read while its child
    writes can end mid-line ("listening on https://127.0.0." has no port)."""
    return text[: text.rfind("\n") + 1].splitlines()


class Child:
    """A process whose stdout and stderr go to `log`."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        split_stderr: bool = False,
        **kw,
    ) -> None:
        """`split_stderr`: stderr goes to its own file beside the log (for a
        caller that reads the two apart), else into the log."""
        self.name = name
        self.log = _LOG_DIR / f"{len(_started):04d}-{re.sub(r'[^A-Za-z0-9]', '-', name)}.log"
        self.err_log = self.log.with_suffix(".stderr.log") if split_stderr else None
        with self.log.open("ab") as out:
            err = self.err_log.open("ab") if self.err_log else None
            try:
                self.proc = subprocess.Popen(
                    argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err or subprocess.STDOUT,
                    **kw,
                )
            finally:
                if err:
                    err.close()
        self.scope = _scope
        _started.append(self)

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stderr_text(self) -> str:
        if self.err_log is None:
            return ""
        try:
            return self.err_log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def describe(self, lines: int = 150) -> str:
        tail = "\n".join(self.text().splitlines()[-lines:])
        text = f"--- {self.name} (pid {self.proc.pid}, log {self.log}):\n{tail}"
        if self.err_log:
            err = "\n".join(self.stderr_text().splitlines()[-lines:])
            text += f"\n--- {self.name} stderr ({self.err_log}):\n{err}"
        return text

    def wait_for_line(self, needle: str, secs: float = 60.0) -> str:
        """The first log line containing `needle`; fails with the log if the
        child exits first or the deadline (scaled) passes."""
        deadline = time.monotonic() + scaled(secs)
        while True:
            for line in complete_lines(self.text()):
                if needle in line:
                    return line
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"{self.name} exited ({self.proc.returncode}) before printing {needle!r}\n"
                    + self.describe()
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.name} did not print {needle!r} within {scaled(secs):.0f} s\n"
                    + self.describe()
                )
            time.sleep(0.05)

    def wait_for_port(self, needle: str, secs: float = 60.0) -> int:
        line = self.wait_for_line(needle, secs)
        port = port_in(line)
        assert port, f"no port in {line!r} from {self.name}"
        return port

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (after SIGCONT, in case it was stopped), then SIGKILL."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(18)  # SIGCONT
                self.proc.terminate()
                self.proc.wait(timeout=scaled(timeout))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_s3_server(
    binary: str, root: Path, access: str, secret: str, env=None
) -> tuple[Child, int]:
    """`lakecache s3-server` with bucket `data` on a port of its own."""
    child = Child(
        "s3-server",
        [binary, "s3-server", "--root", str(root), "--listen", "127.0.0.1:0",
         "--access-key", access, "--secret-key", secret, "--bucket", "data"],
        env=env,
    )  # fmt: skip
    return child, child.wait_for_port("embedded S3 endpoint on")


def start_plain_worker(
    binary: str, cache: Path, s3_port: int, env, *extra: str
) -> tuple[Child, int]:
    """A plain-HTTP worker without tokens over the S3 endpoint on `s3_port`."""
    child = Child(
        "worker",
        [binary, "worker", "--listen", "127.0.0.1:0", "--insecure-http", "--no-auth",
         "--cache-dir", str(cache), "--cache-size", "1GiB",
         "--s3-endpoint", f"http://127.0.0.1:{s3_port}", "--s3-path-style", *extra],
        env=env,
    )  # fmt: skip
    return child, child.wait_for_port("lakecache worker listening on")


def run(
    name: str, argv: list[str], *, env=None, timeout: float = 600.0, check: bool = False, **kw
) -> subprocess.CompletedProcess:
    """Runs `argv` to completion, like `subprocess.run(capture_output=True,
    text=True)`, with its output kept as a child log: stdout in the log,
    stderr beside it, both attached to the report if the test fails. The
    timeout is scaled; on expiry the process is killed and the test fails
    with its output."""
    child = Child(name, argv, env=env, split_stderr=True, **kw)
    try:
        child.proc.wait(timeout=scaled(timeout))
    except subprocess.TimeoutExpired:
        child.proc.kill()
        child.proc.wait()
        raise AssertionError(
            f"{name} ran past {scaled(timeout):.0f} s and was killed\n" + child.describe()
        ) from None
    done = subprocess.CompletedProcess(
        argv, child.proc.returncode, child.text(), child.stderr_text()
    )
    if check and done.returncode != 0:
        raise AssertionError(f"{name} exited {done.returncode}\n" + child.describe())
    return done


@atexit.register
def _stop_leftovers() -> None:
    """No child outlives the test session, whatever a test forgot."""
    for c in _started:
        if c.proc.poll() is None:
            c.proc.kill()
            c.proc.wait()


def begin_scope(scope: str) -> None:
    """Children started from here on belong to `scope` (a test module)."""
    global _scope
    _scope = scope


def logs_of_scope(scope: str) -> str:
    return "\n".join(c.describe() for c in _started if c.scope == scope)


def attach_logs(item, report) -> None:
    """On a failed phase, add the logs of the children its module started."""
    if report.failed:
        text = logs_of_scope(item.module.__name__)
        if text:
            report.sections.append(("lakecache child logs", text))


# The two hooks a conftest imports to put the above in place.
@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    begin_scope(item.module.__name__)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    attach_logs(item, outcome.get_result())
