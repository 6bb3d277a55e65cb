"""`kvwarden bench vllm --tiny --json` end to end, with real vLLM engines (``.venv-vllm``): the
harness runs every case and its report holds every figure. The model and prompts are tiny: the
numbers mean nothing here, but a hit must load what the miss stored, with the same output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.vllm_support import VLLM_PYTHON, require_vllm
from tests.helpers import ROOT, subprocess_env

pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("vllm")]  # one worker: the vLLM engines


def test_bench_vllm_tiny(tmp_path: Path) -> None:
    require_vllm()
    cmd = [sys.executable, "-m", "app.cli", "bench", "vllm", "--tiny", "--json"]
    cmd += ["--results-dir", str(tmp_path), "--vllm-python", str(VLLM_PYTHON)]
    p = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=850)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    (path,) = [line.split(": ", 1)[1] for line in p.stdout.splitlines() if line.startswith("results: ")]
    rep = json.loads(Path(path).read_text())
    assert rep["benchmark"] == "vllm" and rep["tier"] == "tiny"
    cached = rep["cached_tokens"]
    assert cached["none"] == cached["miss"] == cached["vllm_miss"] == 0
    # 600 tokens: two full chunks of 256; the repeat sent at once waits for the miss's store
    assert cached["hit"] == cached["vllm_hit"] == cached["repeat"] == 512
    assert rep["same_output"] is True and rep["repeat_same_as_hit"] is True
    assert set(rep["ttft_s"]) == {"none", "vllm_miss", "vllm_hit", "miss", "repeat", "hit"}
    assert rep["hit_vs_vllm_hit"] > 0 and rep["miss_vs_none"] > 0 and rep["repeat_vs_vllm_hit"] > 0
    assert "kvwarden hit / vLLM hit" in p.stdout
