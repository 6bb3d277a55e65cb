"""The compiled blend rotation: its numerics against RoPE computed directly (the same tolerance
as the torch path), rows gathered and scattered by index, agreement with the torch path that
serves until it is compiled and for the dtypes it does not handle, and its warm-up states."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dataplane.memory import rope_kernel
from dataplane.memory.blendcopy import Geometry, cache_side, chunk_side, keys_of, move
from dataplane.memory.copies import CopySplitter
from dataplane.memory.kvmemory import map_local_tensors
from dataplane.memory.rope import RopeParams, RopeTables, rope_at
from tests.dataplane.memory.test_rope import CONFIGS, HEAD_DIM


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    warm = rope_kernel.KernelWarmup()
    warm.start()
    warm.join(300.0)
    assert warm.state == "ready", warm.state


@pytest.mark.parametrize("params", CONFIGS, ids=lambda p: f"{p.style}-rd{p.rotary_dim}-s{p.scaling:g}")
@pytest.mark.parametrize(("p", "q"), [(0, 512), (512, 0), (37, 2900)])
def test_the_kernel_moves_keys_to_rope_at_the_new_position(params: RopeParams, p: int, q: int) -> None:
    g = torch.Generator().manual_seed(p * 31 + q)
    tokens, heads = 64, 4
    raw = torch.randn(tokens, heads, HEAD_DIM, generator=g)
    pos = torch.arange(tokens)
    cached = rope_at(raw, pos + p, params).to(torch.bfloat16).view(tokens, heads * HEAD_DIM)
    dst = torch.zeros(300, heads * HEAD_DIM, dtype=torch.bfloat16)
    rows = np.random.default_rng(p + q).permutation(300)[:tokens].astype(np.int64)  # scattered rows
    cos, sin = RopeTables(params.check(HEAD_DIM)).angle(q - p)
    rope_kernel.rotate_rows(
        cached,
        np.arange(tokens),
        dst,
        rows,
        cos,
        sin,
        heads,
        HEAD_DIM,
        params.rotary_dim,
        params.style == "neox",
    )
    moved = dst[torch.from_numpy(rows)].view(tokens, heads, HEAD_DIM)
    direct = rope_at(raw, pos + q, params).to(torch.bfloat16)
    err = (moved.float() - direct.float()).abs()
    assert float(err.max()) <= 0.05 and float(err.mean()) <= 0.005, (float(err.max()), float(err.mean()))
    assert torch.equal(
        moved[..., params.rotary_dim :], cached.view(tokens, heads, HEAD_DIM)[..., params.rotary_dim :]
    )
    untouched = np.setdiff1d(np.arange(300), rows)
    assert not dst[torch.from_numpy(untouched)].any()  # no other row written


def test_special_values_propagate_as_in_torch() -> None:
    x = torch.tensor([[float("nan"), 1.0, float("inf"), 2.0, -0.0, 3.0, 1e38, 1e38]], dtype=torch.bfloat16)
    params = RopeParams(2, 10000.0, "neox", 1.0, 64)
    t = RopeTables(params)
    cos, sin = t.angle(5)
    out = torch.empty_like(x)
    one = np.zeros(1, dtype=np.int64)
    rope_kernel.rotate_rows(x, one, out, one, cos, sin, 4, 2, 2, True)
    want = t.shift(x.view(1, 4, 2), 5).view(1, 8)
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.isinf(), want.isinf())
    finite = want.isfinite()
    assert torch.allclose(out[finite].float(), want[finite].float(), rtol=2**-7)


def _cache(dtype: torch.dtype, layers: int, blocks: int, bs: int, heads: int, hd: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randn(2, blocks, bs, heads, hd, generator=g).to(dtype) for _ in range(layers)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_kernel_and_torch_paths_agree_both_ways(dtype: torch.dtype, style: str) -> None:
    """Cache -> chunk (a STORE: keys back by 300) and chunk -> cache (a RETRIEVE: keys on by 300)
    with and without the kernels: the same bytes for values, keys within one rounding. float16
    has no kernel: both runs take the torch path and must be identical."""
    layers, blocks, bs, heads, hd, cs = 3, 12, 8, 2, 64, 32
    params = RopeParams(48, 10000.0, style, 1.0, 2048)
    tables = RopeTables(params.check(hd))
    g = Geometry(dtype, layers, cs, heads, hd)
    kv = map_local_tensors(_cache(dtype, layers, blocks, bs, heads, hd))
    slots = np.concatenate([np.arange(b * bs, (b + 1) * bs) for b in (7, 2, 9, 4)]).astype(np.int64)
    splitter = CopySplitter(2)
    splitter.start()
    try:
        chunks = []
        for ready in (True, False):
            buf = torch.zeros(kv.chunk_nbytes(cs), dtype=torch.uint8)
            dst = chunk_side(buf, g)
            move(tables, cache_side(kv, slots), dst, -300, g, splitter, ready, lambda w: kv.gather(slots, w))
            chunks.append(buf)
        fast, slow = (c.view(dtype).view(layers, 2, cs, heads, hd) for c in chunks)
        assert torch.equal(fast[:, 1], slow[:, 1])  # values: the same bytes
        assert torch.allclose(fast[:, 0].float(), slow[:, 0].float(), rtol=2**-7, atol=1e-6)
        if dtype == torch.float16:
            assert torch.equal(fast, slow)
        # and back: a RETRIEVE of the stored chunk to other slots, keys where they started
        back = np.concatenate([np.arange(b * bs, (b + 1) * bs) for b in (0, 1, 10, 11)]).astype(np.int64)
        stored = chunks[0]
        move(
            tables,
            chunk_side(stored, g),
            cache_side(kv, back),
            300,
            g,
            splitter,
            True,
            lambda w: w.copy_(stored),
            lambda w: kv.scatter(back, w),
        )
        again = torch.zeros_like(stored)
        kv.gather(back, again)
        orig = torch.zeros_like(stored)
        kv.gather(slots, orig)
        o, a = (x.view(dtype).view(layers, 2, cs, heads, hd) for x in (orig, again))
        assert torch.equal(o[:, 1], a[:, 1])
        tol = 0.05 if dtype != torch.float32 else 1e-4
        assert float((o[:, 0].float() - a[:, 0].float()).abs().max()) <= tol
        assert keys_of(stored, g).shape == (layers, cs, heads, hd)
    finally:
        splitter.stop()


def test_warmup_states() -> None:
    w = rope_kernel.KernelWarmup()  # (compiled already by the fixture: ready at once)
    assert w.state == "ready" and w.ready
    w.start()
    w.stop()
    w.join(1.0)
    assert w.state == "ready"
    assert rope_kernel.supported(torch.zeros(1, dtype=torch.bfloat16))
    assert not rope_kernel.supported(torch.zeros(1, dtype=torch.float16))
