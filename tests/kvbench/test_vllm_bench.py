"""`kvwarden bench vllm --tiny --json` end to end, with real vLLM engines (``.venv-vllm``): the
harness runs every case and its report holds every figure. The model and prompts are tiny: the
numbers mean nothing here, but a hit must load what the miss stored, with the same output, and
move the bytes its model's KV takes (a dense model's K and V, an MLA model's latent alone, a
sliding-window hybrid's full layers and each window's last chunk). Every run here is marked
``bench``: whole benchmark runs, out of ``make test``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.vllm_support import VLLM_PYTHON, require_vllm
from tests.helpers import ROOT, subprocess_env

pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("vllm")]  # one worker: the vLLM engines


def _bench(tmp_path: Path, *args: str, name: str = "vllm") -> tuple[dict[str, Any], str]:
    cmd = [sys.executable, "-m", "app.cli", "bench", name, "--tiny", "--json", *args]
    cmd += ["--results-dir", str(tmp_path), "--vllm-python", str(VLLM_PYTHON)]
    p = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=850)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    (path,) = [line.split(": ", 1)[1] for line in p.stdout.splitlines() if line.startswith("results: ")]
    rep: dict[str, Any] = json.loads(Path(path).read_text())
    return rep, p.stdout


# A whole benchmark run (two minutes on a 2-core host): with KVWARDEN_BENCH=1 or -m bench. make
# test covers its paths with real engines: hits equal to misses, bytes moved (tests/e2e).
@pytest.mark.bench
def test_bench_vllm_tiny(tmp_path: Path) -> None:
    require_vllm()
    rep, out = _bench(tmp_path)
    assert rep["benchmark"] == "vllm" and rep["tier"] == "tiny"
    cached = rep["cached_tokens"]
    assert cached["none"] == cached["miss"] == cached["vllm_miss"] == 0
    # 600 tokens: two full chunks of 256; the repeat sent at once waits for the miss's store
    assert cached["hit"] == cached["vllm_hit"] == cached["repeat"] == 512
    assert rep["same_output"] is True and rep["repeat_same_as_hit"] is True
    assert set(rep["ttft_s"]) == {"none", "vllm_miss", "vllm_hit", "miss", "repeat", "hit"}
    assert rep["hit_vs_vllm_hit"] > 0 and rep["miss_vs_none"] > 0 and rep["repeat_vs_vllm_hit"] > 0
    assert "kvwarden hit / vLLM hit" in out
    # TINY: 2 layers x 2 KV heads x 64 x K and V x 2 bytes a token, for each of 512 tokens
    assert rep["retrieve_bytes_per_hit"] == 512 * 1024 and rep["retrieve_bytes_per_hit_token"] == 1024


# The model kinds' runs are whole benchmarks more (minutes): with KVWARDEN_BENCH=1 or -m bench.
# make test checks each kind's bytes a hit moves with real engines (tests/e2e/test_vllm_models.py).
@pytest.mark.bench
def test_bench_vllm_tiny_mla_moves_the_latent_alone(tmp_path: Path) -> None:
    require_vllm()
    rep, out = _bench(tmp_path, "--model-kind", "mla")
    cached = rep["cached_tokens"]
    assert cached["none"] == cached["miss"] == 0
    # 600 tokens: two chunks of 256 (a hit leaves two tokens at least); vLLM's own 16-token blocks
    assert cached["hit"] == cached["repeat"] == 512 and cached["vllm_hit"] == 592
    # two hits on the same boundary are the same computation; a full prefill is not (MLA's context
    # path rounds otherwise: tests/e2e/test_vllm_models.py compares hits with vLLM's own)
    assert rep["repeat_same_as_hit"] is True
    # 4 layers x one latent of 576 x 2 bytes a token
    assert rep["retrieve_bytes_per_hit_token"] == 4 * 576 * 2 and "mla model" in out


@pytest.mark.bench
def test_bench_vllm_tiny_gemma3_moves_each_windows_last_chunk_alone(tmp_path: Path) -> None:
    require_vllm()
    rep, out = _bench(tmp_path, "--model-kind", "gemma3")
    cached = rep["cached_tokens"]
    # 600 tokens: two chunks of 256; vLLM's own 128-token blocks (one token left at least)
    assert cached["hit"] == cached["repeat"] == cached["vllm_hit"] == 512
    assert rep["same_output"] is True and rep["repeat_same_as_hit"] is True
    # the full layer's 512 tokens and each of the three windows' last chunk (256 tokens), at
    # 2 KV heads x 64 x K and V x 2 bytes a token and layer
    assert rep["retrieve_bytes_per_hit"] == (512 + 3 * 256) * 512 and "gemma3 model" in out


@pytest.mark.bench
def test_bench_handoff_tiny_decodes_from_the_prefills_chunks(tmp_path: Path) -> None:
    require_vllm()
    rep, out = _bench(tmp_path, name="handoff")
    cached = rep["cached_tokens"]
    # 600 tokens: two full chunks of 256 handed off; the decode computes the 88 after them
    assert cached["decode"] == cached["vllm_hit"] == 512 and cached["prefill"] == 0
    assert rep["decode_computed_tokens"] == [88] and rep["handed_params"] is True
    assert rep["decode_vs_vllm_hit"] > 0 and "decode / vLLM hit" in out
    # handed the tail too, it computes the prompt's last token alone
    assert cached["decode_tail"] == 599 and cached["prefill_tail"] == 0
    assert rep["decode_tail_computed_tokens"] == [1] and rep["decode_tail_vs_vllm_hit"] > 0
