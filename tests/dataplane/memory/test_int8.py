"""int8 chunks (`dataplane.memory.int8`): sizes, round trips within half a step, keys per
channel and values per token, and the worker-side copies through `Int8KV`."""

from __future__ import annotations

import pytest
import torch

from dataplane.memory.blockkv import BlockKV
from dataplane.memory.copies import Blocks, CopySplitter
from dataplane.memory.int8 import Int8Codec, Int8KV, Int8Shape
from dataplane.memory.kvmemory import map_local_tensors
from dataplane.wire.kinds import KVFormat

L, H, D, BS, T = 3, 2, 8, 4, 16


def _chunk(shape: Int8Shape, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape.elements(T), generator=g) * 3 + 1).to(dtype)


def _round_trip(shape: Int8Shape, raw: torch.Tensor, splitter: CopySplitter | None = None) -> torch.Tensor:
    codec = Int8Codec(shape)
    packed = torch.empty(shape.chunk_nbytes(T), dtype=torch.uint8)
    codec.encode(raw, packed, T, splitter)
    out = torch.empty_like(raw)
    codec.decode(packed, out, T, splitter)
    return out


def _steps(shape: Int8Shape, raw: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per plane: (the original, the round trip, each element's step) in the plane's view."""
    out = _round_trip(shape, raw)
    res = []
    for (rv, dims), (ov, _) in zip(
        shape.planes(raw.float(), T, L), shape.planes(out.float(), T, L), strict=True
    ):
        lo, hi = rv, rv
        for d in dims:
            lo, hi = lo.amin(d, keepdim=True), hi.amax(d, keepdim=True)
        res.append((rv, ov, ((hi - lo) / 255).expand_as(rv)))
    return res


FORMATS = [KVFormat.TOKEN_MAJOR, KVFormat.VLLM_CPU, KVFormat.VLLM_CPU_AMX, KVFormat.LATENT]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_round_trip_is_within_half_a_step_of_each_value(fmt: KVFormat) -> None:
    shape = Int8Shape(fmt, L, 1 if fmt is KVFormat.LATENT else H, D, BS)
    raw = _chunk(shape)
    for rv, ov, step in _steps(shape, raw):
        # half a step, plus the engine dtype's own rounding of the result
        bound = step / 2 + rv.abs() * 2**-8
        assert bool(((ov - rv).abs() <= bound * 1.0001).all())
    assert not torch.equal(_round_trip(shape, raw), raw)  # lossy: it is not the raw chunk


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_int8_chunk_is_about_half_the_bytes(fmt: KVFormat) -> None:
    shape = Int8Shape(fmt, 30, 1 if fmt is KVFormat.LATENT else 3, 64, 16)
    raw_bytes = shape.elements(256) * 2
    assert 1.9 <= raw_bytes / shape.chunk_nbytes(256) < 2.0


def test_a_key_channel_keeps_its_own_range_and_a_value_token_its_own() -> None:
    """An outlier channel of the keys (or token of the values) coarsens only itself."""
    shape = Int8Shape(KVFormat.TOKEN_MAJOR, L, H, D, BS)
    raw = _chunk(shape).view(L, 2, T, H * D)
    raw[:, 0, :, 5] *= 1000  # a key channel with a 1000x range
    raw[:, 1, 7, :] *= 1000  # a value token with a 1000x range
    out = _round_trip(shape, raw.flatten()).view(L, 2, T, H * D).float()
    err = (out - raw.float()).abs()
    others_k = torch.cat([err[:, 0, :, :5], err[:, 0, :, 6:]], dim=2)
    others_v = torch.cat([err[:, 1, :7], err[:, 1, 8:]], dim=1)
    assert float(others_k.max()) < 0.1 < float(err[:, 0, :, 5].max())
    assert float(others_v.max()) < 0.1 < float(err[:, 1, 7].max())


def test_a_constant_channel_and_float16_and_float32_come_back_exactly_or_within_a_step() -> None:
    shape = Int8Shape(KVFormat.TOKEN_MAJOR, L, H, D, BS)
    raw = torch.full((shape.elements(T),), 0.75, dtype=torch.bfloat16)
    assert torch.equal(_round_trip(shape, raw), raw)
    for dtype in (torch.float16, torch.float32):
        raw = _chunk(shape, 3, dtype)
        for rv, ov, step in _steps(shape, raw):
            assert bool(((ov - rv).abs() <= step / 2 + rv.abs() * 2**-10).all())


def test_split_layers_give_the_same_bytes() -> None:
    shape = Int8Shape(KVFormat.VLLM_CPU, 5, H, D, BS)
    raw = (torch.randn(shape.elements(T)) * 2).to(torch.bfloat16)
    one, two = Int8Codec(shape), Int8Codec(shape)
    a = torch.empty(shape.chunk_nbytes(T), dtype=torch.uint8)
    b = torch.empty_like(a)
    splitter = CopySplitter(2)
    splitter.start()
    try:
        one.encode(raw, a, T)
        two.encode(raw, b, T, splitter)
    finally:
        splitter.stop()
    assert torch.equal(a, b)


def test_a_buffer_of_the_wrong_size_is_refused() -> None:
    shape = Int8Shape(KVFormat.TOKEN_MAJOR, L, H, D, BS)
    codec = Int8Codec(shape)
    raw = _chunk(shape)
    with pytest.raises(ValueError, match="int8 chunk of 16 tokens is"):
        codec.encode(raw, torch.empty(shape.chunk_nbytes(T) - 4, dtype=torch.uint8), T)


def test_int8kv_moves_a_chunk_of_vllm_cpu_blocks_and_refuses_quantized_kv() -> None:
    caches = [(torch.randn(8, H, BS, 2 * D) * 2).to(torch.bfloat16) for _ in range(L)]
    local = BlockKV.of_engine(caches, KVFormat.VLLM_CPU)
    kv = Int8KV(local, Int8Shape(KVFormat.VLLM_CPU, L, H, D, BS), torch.bfloat16)
    buf = torch.empty(kv.chunk_nbytes(T), dtype=torch.uint8)
    src = Blocks(torch.tensor([5, 1, 6, 2]).numpy(), BS)
    kv.gather(src, buf)
    assert kv.tokens_of(buf.numel()) == T
    want = [c[[5, 1, 6, 2]].clone() for c in caches]
    for c in caches:
        c.zero_()
    kv.scatter(Blocks(torch.tensor([0, 3, 4, 7]).numpy(), BS), buf)
    for c, w in zip(caches, want, strict=True):
        got = c[[0, 3, 4, 7]].float()
        assert float((got - w.float()).abs().max()) < 0.1  # within half a step of randn * 2
        assert float(c[[1, 2, 5, 6]].abs().max()) == 0  # nothing written elsewhere
    with pytest.raises(ValueError, match="quantizes float KV"):
        Int8KV(local, kv.codec.shape, torch.float8_e4m3fn)


def test_int8kv_over_token_major_memory() -> None:
    caches = [(torch.randn(2, 8, BS, H, D)).to(torch.bfloat16) for _ in range(L)]
    local = map_local_tensors(caches)
    kv = Int8KV(local, Int8Shape(KVFormat.TOKEN_MAJOR, L, H, D, BS), torch.bfloat16)
    buf = torch.empty(kv.chunk_nbytes(T), dtype=torch.uint8)
    kv.gather(Blocks(torch.tensor([0, 1, 2, 3]).numpy(), BS), buf)
    kv.scatter(Blocks(torch.tensor([4, 5, 6, 7]).numpy(), BS), buf)
    for c in caches:
        assert float((c[:, 4:8].float() - c[:, 0:4].float()).abs().max()) < 0.05
