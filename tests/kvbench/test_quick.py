"""The whole suite with ``--quick``: under two minutes on a 2-core machine, every figure reported.
Marked ``bench``: deselected unless asked for (``pytest -m bench`` or ``KVWARDEN_BENCH=1``)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, subprocess_env
from tests.kvbench.figures import CHECKS, report


@pytest.mark.bench
@pytest.mark.timeout(400)
def test_quick_suite_in_two_minutes(tmp_path: Path) -> None:
    t0 = time.monotonic()
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "bench",
            "all",
            "--quick",
            "--json",
            "--results-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=380,
    )
    took = time.monotonic() - t0
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    for name, check in CHECKS.items():
        check(report(tmp_path, name))
    assert took < 120, f"bench all --quick took {took:.0f} s"
