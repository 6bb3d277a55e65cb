"""The lossless codec of 16-bit float chunks: bit-exact round trips, what it declines to code,
and coded bytes that do not decode (a clear error, never wrong bytes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dataplane.storage import compress
from dataplane.storage.compress.planes import MIN_SAVING, CodedChunkError, decode_into, encode


def kv_like(n: int, dtype: torch.dtype, seed: int = 0) -> memoryview:
    """``n`` elements shaped like KV: normal values, a scale per channel of 64."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n // 64, 64, generator=g) * torch.rand(64, generator=g) * 4
    return memoryview(x.to(dtype).contiguous().view(torch.uint8).numpy()).cast("B")


def back(coded: bytes, n: int) -> bytes:
    out = bytearray(n)
    decode_into(coded, memoryview(out))
    return bytes(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kv_chunks_round_trip_bit_exact_and_smaller(dtype: torch.dtype) -> None:
    raw = kv_like(1 << 16, dtype)
    name = str(dtype).removeprefix("torch.")
    coded = encode(raw, name)
    assert coded is not None and back(coded, raw.nbytes) == bytes(raw)
    ratio = raw.nbytes / len(coded)
    # bfloat16's 8 exponent bits are most of its high byte; float16's high byte keeps 2 of
    # mantissa, and codes less
    assert ratio > (1.35 if dtype == torch.bfloat16 else 1.1), ratio


def test_special_values_survive() -> None:
    vals = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -3.0e38] * 4096)
    raw = memoryview(vals.to(torch.bfloat16).view(torch.uint8).numpy()).cast("B")
    coded = encode(raw, "bfloat16")
    assert coded is not None and back(coded, raw.nbytes) == bytes(raw)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "int8", "uint8", "float32", None])
def test_other_dtypes_are_stored_raw(dtype: str | None) -> None:
    assert encode(kv_like(1 << 14, torch.bfloat16), dtype) is None
    assert compress.encode(kv_like(1 << 14, torch.bfloat16), dtype, "lossless") is None


def test_a_chunk_that_saves_under_five_percent_is_stored_raw() -> None:
    noise = memoryview(np.random.default_rng(1).integers(0, 256, 1 << 16, dtype=np.uint8)).cast("B")
    assert encode(noise, "bfloat16") is None  # uniform bytes: nothing to code
    assert MIN_SAVING == 0.05
    assert encode(memoryview(b"\x01"), "bfloat16") is None  # (an odd length is no 16-bit chunk)


def test_the_setting_none_codes_nothing() -> None:
    raw = kv_like(1 << 14, torch.bfloat16)
    assert compress.encode(raw, "bfloat16", "none") is None
    codec, coded = compress.encode(raw, "bfloat16", "lossless") or (0, b"")
    assert codec == compress.PLANES and len(coded) < raw.nbytes


def test_coded_bytes_that_do_not_decode_raise_never_fill_wrong_bytes() -> None:
    raw = kv_like(1 << 14, torch.bfloat16)
    coded = encode(raw, "bfloat16")
    assert coded is not None
    out = memoryview(bytearray(raw.nbytes))
    with pytest.raises(CodedChunkError, match="planes"):
        decode_into(coded[:-1], out)  # truncated
    with pytest.raises(CodedChunkError):
        decode_into(coded, memoryview(bytearray(raw.nbytes + 2)))  # another chunk size
    bad = bytearray(coded)
    bad[6] ^= 0xFF  # inside the zstandard frame's header
    with pytest.raises(CodedChunkError):
        decode_into(bytes(bad), out)
    with pytest.raises(CodedChunkError, match="unknown codec"):
        compress.decode_into(7, coded, out)
