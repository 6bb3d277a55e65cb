"""Lossless coding of 16-bit float chunks (bfloat16, float16) for the slower tiers.

A chunk of 16-bit words is split into two byte planes: the high bytes (sign and exponent, and
for float16 two bits of mantissa) and the low bytes (mantissa). The exponents of KV are few and
skewed (about 2.5 to 3 bits of information in bfloat16's 8), so the high plane is entropy-coded
with zstandard (its Huffman coding of literals does the work: matches are searched for little,
which codes as well as level 1 and decodes faster); the low plane is near uniform and is kept as
it is. The coded chunk is

    high plane length   u32   (little-endian)
    high plane          a zstandard frame of n/2 bytes
    low plane           n/2 bytes, as they are

Measured on the KV of a trained model (SmolLM2-135M, bfloat16): 1.46x smaller, against 1.46x
for the exact 8-bit exponent plane and a bound of 1.46x from its entropy; blosc2's byte shuffle
with zstd gives the same ratio but codes the incompressible low plane too (BENCHMARKS.md,
"Compressed chunks", `kvwarden bench codec`). A chunk that would not shrink by `MIN_SAVING` is
not coded: `encode` answers None and the caller stores it raw; so are chunks of other dtypes
(fp8, int8: quantized, near uniform).
"""

from __future__ import annotations

import struct

import numpy as np
import zstandard

WORD_DTYPES = ("bfloat16", "float16")  # the dtypes `encode` codes; every other is stored raw
MIN_SAVING = 0.05  # a coded chunk must be at least this much smaller than the raw one
# level 1 with the match search cut short: exponent bytes have few long repeats, and the
# literals' Huffman coding is what shrinks them (1.475x a trained model's KV, against 1.463x at
# level 1, and decoded 1.3x as fast)
_PARAMS = zstandard.ZstdCompressionParameters.from_level(
    1, min_match=7, search_log=1, hash_log=10, chain_log=6
)
_LEN = struct.Struct("<I")


class CodedChunkError(ValueError):
    """A coded chunk that does not decode to the bytes it names (damaged, or not one)."""


def encode(payload: memoryview, dtype: str | None) -> bytes | None:
    """``payload`` (a chunk of ``dtype`` elements) coded, or None when it is stored raw: not a
    16-bit float chunk, or not `MIN_SAVING` smaller coded. Runs on a tier's writer thread."""
    n = payload.nbytes
    if dtype not in WORD_DTYPES or n < 2 or n % 2:
        return None
    raw = np.frombuffer(payload, dtype=np.uint8)
    high = np.ascontiguousarray(raw[1::2])  # (little-endian words: the high byte second)
    coded = zstandard.ZstdCompressor(compression_params=_PARAMS).compress(high.data)
    size = _LEN.size + len(coded) + n // 2
    if size > n * (1 - MIN_SAVING):
        return None
    out = bytearray(size)
    _LEN.pack_into(out, 0, len(coded))
    out[_LEN.size : _LEN.size + len(coded)] = coded
    np.frombuffer(out, dtype=np.uint8, offset=_LEN.size + len(coded))[:] = raw[0::2]
    return bytes(out)


def decode_into(coded: memoryview | bytes, out: memoryview) -> None:
    """Decode ``coded`` into ``out`` (the raw chunk's size); CodedChunkError when it does not
    decode to exactly that many bytes."""
    data = memoryview(coded).cast("B")
    n = out.nbytes
    if n % 2 or data.nbytes < _LEN.size:
        raise CodedChunkError(f"{data.nbytes} coded bytes cannot hold a chunk of {n}")
    (hlen,) = _LEN.unpack_from(data)
    if _LEN.size + hlen + n // 2 != data.nbytes:
        raise CodedChunkError(f"planes of {hlen} and {data.nbytes - _LEN.size - hlen} bytes, chunk of {n}")
    try:
        high = zstandard.ZstdDecompressor().decompress(
            data[_LEN.size : _LEN.size + hlen], max_output_size=n // 2
        )
    except zstandard.ZstdError as exc:
        raise CodedChunkError(f"high plane: {exc}") from None
    if len(high) != n // 2:
        raise CodedChunkError(f"high plane of {len(high)} bytes, chunk of {n}")
    words = np.frombuffer(out, dtype=np.uint16)  # (two passes: 4.6 GB/s here, two strided copies 3.5)
    np.left_shift(np.frombuffer(high, dtype=np.uint8), 8, out=words, dtype=np.uint16)
    words |= np.frombuffer(data, dtype=np.uint8, offset=_LEN.size + hlen)
