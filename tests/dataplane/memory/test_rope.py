"""RoPE re-rotation numerics: keys cached at one position, moved to another with the per-model
tables, equal RoPE computed at the new position directly (within bf16 tolerance, the precision
chunks are stored in); values are not touched; bad parameters are named."""

from __future__ import annotations

import math

import pytest
import torch

from dataplane.memory.rope import MAX_POSITIONS, RopeParams, RopeTables, rope_at

HEAD_DIM = 128
CONFIGS = [
    RopeParams(128, 10000.0, "neox", 1.0, 4096),  # full rotary dim, NeoX pairs (Llama)
    RopeParams(128, 10000.0, "interleaved", 1.0, 4096),  # GPT-J style pairs
    RopeParams(64, 10000.0, "neox", 1.0, 4096),  # partial rotary dim
    RopeParams(32, 500000.0, "interleaved", 1.0, 4096),  # partial, another base
    RopeParams(128, 10000.0, "neox", 4.0, 8192),  # linear scaling
    RopeParams(96, 1000000.0, "interleaved", 2.5, 8192),  # partial, interleaved, scaled
]


@pytest.mark.parametrize("params", CONFIGS, ids=lambda p: f"{p.style}-rd{p.rotary_dim}-s{p.scaling:g}")
@pytest.mark.parametrize(("p", "q"), [(0, 512), (512, 0), (37, 2900), (1000, 1001)])
def test_shifting_cached_keys_equals_rope_at_the_new_position(params: RopeParams, p: int, q: int) -> None:
    g = torch.Generator().manual_seed(p * 7919 + q)
    tokens, heads = 256, 4
    raw = torch.randn(tokens, heads, HEAD_DIM, generator=g)
    pos = torch.arange(tokens)
    cached = rope_at(raw, pos + p, params).to(torch.bfloat16)  # what a chunk holds
    moved = RopeTables(params.check(HEAD_DIM)).shift(cached, q - p)
    direct = rope_at(raw, pos + q, params).to(torch.bfloat16)
    assert moved.dtype == torch.bfloat16
    err = (moved.float() - direct.float()).abs()
    # two bf16 roundings (the cached chunk, the result): a few units in the last place of |k|
    assert float(err.max()) <= 0.05 and float(err.mean()) <= 0.005, (float(err.max()), float(err.mean()))
    assert torch.equal(moved[..., params.rotary_dim :], cached[..., params.rotary_dim :])  # not rotated
    if p != q:  # and the shift did something: the cached keys are not the keys at q
        assert float((cached.float() - direct.float()).abs().max()) > 0.5


def test_a_shift_is_exact_in_float32_and_undone_by_its_opposite() -> None:
    params = RopeParams(128, 10000.0, "neox", 1.0, 4096)
    t = RopeTables(params)
    k = torch.randn(16, 2, HEAD_DIM)
    k0 = k.clone()
    back = t.shift(t.shift(k, 700), -700)
    assert torch.equal(k, k0)  # the caller's keys are never rotated in place
    assert torch.allclose(back, k, atol=1e-5)
    assert torch.allclose(t.shift(k, 0), k) and t.shift(k, 0) is not k
    with pytest.raises(ValueError, match="beyond max_positions 4096"):
        t.shift(k, 4096)


@pytest.mark.parametrize(
    ("params", "named"),
    [
        (RopeParams(127, 10000.0, "neox", 1.0, 4096), "rotary_dim: 127 must be a positive even"),
        (RopeParams(0, 10000.0, "neox", 1.0, 4096), "rotary_dim: 0"),
        (RopeParams(256, 10000.0, "neox", 1.0, 4096), "rotary_dim: 256 exceeds the head dim 128"),
        (RopeParams(128, 0.0, "neox", 1.0, 4096), "base: 0.0 must be a finite number > 0"),
        (RopeParams(128, -5.0, "neox", 1.0, 4096), "base: -5.0"),
        (RopeParams(128, math.nan, "neox", 1.0, 4096), "base: nan"),
        (RopeParams(128, math.inf, "neox", 1.0, 4096), "base: inf"),
        (RopeParams(128, 10000.0, "neox", math.nan, 4096), "scaling: nan"),
        (RopeParams(128, 10000.0, "neox", 0.0, 4096), "scaling: 0.0"),
        (RopeParams(128, 10000.0, "gptj", 1.0, 4096), "style: 'gptj'"),
        (RopeParams(128, 10000.0, "neox", 1.0, 0), "max_positions: 0"),
        (RopeParams(128, 10000.0, "neox", 1.0, MAX_POSITIONS + 1), f"max_positions: {MAX_POSITIONS + 1}"),
        (RopeParams(128, 10000.0, "neox", 1.0, 10**12), "max_positions: 1000000000000"),
    ],
)
def test_bad_parameters_are_named(params: RopeParams, named: str) -> None:
    with pytest.raises(ValueError) as exc:
        params.check(HEAD_DIM)
    assert named in str(exc.value)


def test_tables_are_bounded() -> None:
    t = RopeTables(RopeParams(128, 10000.0, "neox", 1.0, MAX_POSITIONS))
    assert t.nbytes == MAX_POSITIONS * 64 * 8 <= 64 << 20
