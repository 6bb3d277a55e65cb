"""`kvwarden bench all --tiny --json` in a subprocess: every benchmark runs end to end against real
processes and its report holds every figure; `scripts/plot_bench.py` draws the figure and
regenerates a table between its markers. The sizes are tiny: the numbers mean nothing here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from app.cli import main as kvwarden
from tests.helpers import ROOT, subprocess_env
from tests.kvbench.figures import CHECKS, report

pytestmark = pytest.mark.timeout(300)


def _kvwarden(*args: str, timeout: float = 280) -> subprocess.CompletedProcess[str]:
    """``kvwarden ARGS`` in a subprocess (its own processes, its own interpreter state)."""
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench-results")
    p = _kvwarden("bench", "all", "--tiny", "--json", "--results-dir", str(out))
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    written = [line.split(": ", 1)[1] for line in p.stdout.splitlines() if line.startswith("results: ")]
    assert sorted(Path(w).name.split("-")[0] for w in written) == sorted(CHECKS)
    return out


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_report_has_every_figure(results: Path, name: str) -> None:
    CHECKS[name](report(results, name))


def test_plot_and_table(results: Path, tmp_path: Path) -> None:
    md = tmp_path / "B.md"
    md.write_text("# head\n\n<!-- table -->\nOLD TABLE\n<!-- /table -->\n\ntail\n")
    png = tmp_path / "plot.png"
    p = subprocess.run(
        [
            sys.executable,
            "scripts/plot_bench.py",
            "--results-dir",
            str(results),
            "--out",
            str(png),
            "--markdown",
            str(md),
        ],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = md.read_text()
    assert text.startswith("# head\n\n<!-- table -->\n") and text.endswith("<!-- /table -->\n\ntail\n")
    assert "OLD TABLE" not in text and "**Targets**" in text and "RETRIEVE/memcpy" in text


@pytest.mark.parametrize(
    "args",
    [
        ["transfer", "--modes", "sideways"],
        ["transfer", "--chunk-sizes", "0"],
        ["transfer", "--chunk-size", "20"],  # not a multiple of the block size
        ["reaper", "--instances", "ten"],
        ["startup", "--rounds", "0"],
        ["all", "--only", "nothing"],
    ],
)
def test_bad_flags_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert kvwarden(["bench", *args]) == 2  # refused before anything starts
    assert capsys.readouterr().err.startswith("bench: ")


def test_startup_without_waiting_for_the_arena(tmp_path: Path) -> None:
    """What ``--quick`` does: the first PING and the memory then, the server stopped while its
    arena is still being faulted in (and stopping it then is clean)."""
    p = _kvwarden(
        "bench", "startup", "--tiny", "--arena-ready", "skip", "--json", "--results-dir", str(tmp_path)
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    rep = report(tmp_path, "startup")
    assert rep["params"]["arena_ready"] == "skip" and rep["arena_ready_s"] is None
    CHECKS["startup"](rep)
    assert "not waited for" in p.stdout
