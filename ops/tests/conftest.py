"""Every child a test here starts keeps its output, shown when it fails."""

from __future__ import annotations

import sys
from pathlib import Path

# The shared process helpers (scripts/testsupport/testproc.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "testsupport"))
from testproc import pytest_runtest_makereport, pytest_runtest_setup  # noqa: E402, F401
