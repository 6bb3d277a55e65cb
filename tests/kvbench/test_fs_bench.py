"""`kvwarden bench fs --tiny` with its files on a tmpfs (``/dev/shm``): every figure reported,
and the O_DIRECT baseline said to be unsupported there (memory has no disk to read past the page
cache to) rather than given a ratio. The sizes are tiny: the numbers mean nothing here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from app.cli import main as kvwarden
from kvbench.fs import filesystem
from tests.helpers import ROOT, subprocess_env
from tests.kvbench.figures import check_fs, report

SHM = Path("/dev/shm")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("chunks", [1, 3])
def test_fs_bench_on_tmpfs(tmp_path: Path, chunks: int) -> None:
    assert filesystem(SHM)["type"] == "tmpfs"  # (the server's own L1 segments live there)
    args = ["bench", "fs", "--tiny", "--dir", str(SHM), "--json", "--results-dir", str(tmp_path)]
    args += ["--chunks-per-request", str(chunks)]
    p = subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    rep = report(tmp_path, "fs")
    check_fs(rep)
    assert rep["filesystem"]["type"] == "tmpfs" and rep["params"]["chunks_per_request"] == chunks
    assert rep["server_fs"]["hits"] == 2 * 2 * chunks  # (tiny: 2 prompts fresh, 2 warm)
    assert rep["direct_io"].startswith("not supported on this file system")
    assert "not supported on this file system" in p.stdout  # in the table, in place of a time
    (root,) = re.findall(r"bench fs: files under (\S+): ", p.stdout)
    assert Path(root).parent == SHM and not Path(root).exists()  # removed at the end


@pytest.mark.parametrize(
    "args",
    [["--files", "0"], ["--samples", "0"], ["--chunks-per-request", "0"], ["--dir", "/nonexistent/dir"]],
)
def test_bad_flags_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert kvwarden(["bench", "fs", *args]) == 2  # refused before anything starts
    assert capsys.readouterr().err.startswith("bench: ")
