"""Every child a test here starts keeps its output, shown when it fails."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The shared process helpers (scripts/testsupport/testproc.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "testsupport"))
import testproc  # noqa: E402


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    testproc.begin_scope(item.module.__name__)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    testproc.attach_logs(item, outcome.get_result())
