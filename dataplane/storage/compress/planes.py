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

Measured on the KV of a trained model (SmolLM2-135M, bfloat16): 1.47x smaller (the chunks vLLM
stores of it: 1.49x), against 1.46x for the exact 8-bit exponent plane and a bound of 1.46x from
its entropy; blosc2's byte shuffle with zstd gives about the same ratio but codes the
incompressible low plane too, and decodes slower (BENCHMARKS.md, "Compressed chunks",
`kvwarden bench codec`). A chunk that would not shrink by `MIN_SAVING` is
not coded: `encode` answers None and the caller stores it raw; so are chunks of other dtypes
(fp8, int8: quantized, near uniform).

Splitting a chunk into its planes and joining them back are numba kernels (`planes_jit`), one
pass each, compiled once a process on a thread of its own (`WARMUP`: by a tier that codes, when
it starts, else by the first coded chunk read); until they are ready, numpy does both in two
passes. `StreamDecoder` decodes a chunk while it arrives: the high plane once it is in, the low
plane piece by piece as it lands.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np
import zstandard

from dataplane.memory.jit import CompileWarmup

WORD_DTYPES = ("bfloat16", "float16")  # the dtypes `encode` codes; every other is stored raw
MIN_SAVING = 0.05  # a coded chunk must be at least this much smaller than the raw one
# level 1 with the match search cut to its least (the smallest hash table): exponent bytes have
# few long repeats, and the literals' Huffman coding is what shrinks them; each match found is
# a sequence the decoder must run, so fewer decode faster (a trained model's KV: 1.472x, decoded
# 1.24x as fast as with a table of 2**10, which coded 1.475x; level 1: 1.463x, 1.6x slower)
_PARAMS = zstandard.ZstdCompressionParameters.from_level(
    1, min_match=7, search_log=1, hash_log=6, chain_log=6
)
_LEN = struct.Struct("<I")
_kernels: dict[str, Any] = {}  # name -> compiled kernel (`planes_jit`); filled once by WARMUP


def _compile() -> dict[str, Any]:
    from dataplane.storage.compress import planes_jit  # numba: imported only now

    return planes_jit.compile_all()


# the process's one compile of the kernels (start: idempotent; the tiers join it as they stop)
WARMUP = CompileWarmup(
    _kernels, _compile, "kvwarden-planes-jit", "compress: compiled plane kernels", "using numpy's passes"
)


@contextlib.contextmanager
def numpy_passes() -> Iterator[None]:
    """While open, every call in this process splits and joins with numpy, as a process does
    before its compile is done (tests, and `kvwarden bench codec`'s figure for that time)."""
    saved = dict(_kernels)
    _kernels.clear()
    try:
        yield
    finally:
        _kernels.update(saved)


class CodedChunkError(ValueError):
    """A coded chunk that does not decode to the bytes it names (damaged, or not one)."""


def encode(payload: memoryview, dtype: str | None) -> bytes | None:
    """``payload`` (a chunk of ``dtype`` elements) coded, or None when it is stored raw: not a
    16-bit float chunk, or not `MIN_SAVING` smaller coded. Runs on a tier's writer thread."""
    n = payload.nbytes
    if dtype not in WORD_DTYPES or n < 2 or n % 2:
        return None
    raw = np.frombuffer(payload, dtype=np.uint8)
    high, low = np.empty(n // 2, dtype=np.uint8), np.empty(n // 2, dtype=np.uint8)
    if not _split(raw, high, low):
        high[:] = raw[1::2]  # (little-endian words: the high byte second)
        low[:] = raw[0::2]
    coded = zstandard.ZstdCompressor(compression_params=_PARAMS).compress(high.data)
    if _LEN.size + len(coded) + n // 2 > n * (1 - MIN_SAVING):
        return None
    return b"".join((_LEN.pack(len(coded)), coded, low.data))


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
    hi = np.frombuffer(high, dtype=np.uint8)
    lo = np.frombuffer(data, dtype=np.uint8, offset=_LEN.size + hlen)
    words = np.frombuffer(out, dtype=np.uint16)
    if not _join(hi, lo, words):
        np.left_shift(hi, 8, out=words, dtype=np.uint16)  # (two passes: 4.6 GB/s here)
        words |= lo


def _split(raw: np.ndarray, high: np.ndarray, low: np.ndarray) -> bool:
    """The planes of ``raw`` into ``high`` and ``low`` by the kernel; False: not compiled (yet),
    or not for arrays of this kind (an unaligned view): the caller splits them with numpy."""
    kernel = _kernels.get("split")
    if kernel is None or raw.ctypes.data % 2:
        return False
    try:
        kernel(raw.view(np.uint16), high, low)
    except TypeError:
        return False
    return True


def _join(high: np.ndarray, low: np.ndarray, words: np.ndarray) -> bool:
    """``words`` from the two planes by the kernel (its compile started if it had not been);
    False: the caller joins them with numpy."""
    kernel = _kernels.get("join")
    if kernel is None:
        if WARMUP.state == "idle":
            WARMUP.start()
        return False
    try:
        kernel(high, low, words)
    except TypeError:
        return False
    return True


PIECE = 1 << 20  # the low plane is received and joined in pieces of this many bytes


class StreamDecoder:
    """Decodes a coded chunk while its bytes arrive (the remote tier's reads): the receiver asks
    `next_buffer` where the next bytes go, fills it, and says `filled`, until it answers None;
    then, its own checks of the bytes passed (the value hash), `finish`. The high plane is
    decoded as soon as it is in, while the low plane is still on its way, and each piece of the
    low plane is joined into ``out`` as it lands. Bytes that do not decode are remembered, not
    raised, so that the receiver takes the whole value off its connection and judges its hash
    first; `finish` raises CodedChunkError for them. ``out`` holds the chunk only once
    `finish` returned."""

    def __init__(self, out: memoryview, nbytes: int) -> None:
        self.out = out
        self._words = np.frombuffer(out, dtype=np.uint16) if out.nbytes % 2 == 0 else None
        self._n = out.nbytes  # the chunk's size decoded
        self._left = nbytes  # coded bytes still to come
        self._error = "" if self._words is not None else f"a chunk of {out.nbytes} bytes is no 16-bit one"
        self._buf: memoryview = memoryview(bytearray(min(nbytes, _LEN.size)))
        self._stage = "length"  # then "high", "low"
        self._high: np.ndarray | None = None
        self._at = 0  # words joined so far
        self._piece: memoryview | None = None  # where each piece of the low plane lands

    def next_buffer(self) -> memoryview | None:
        """Where the next coded bytes go (all of it to be filled); None: the value is all in."""
        return self._buf if self._left > 0 else None

    def filled(self) -> None:
        """The buffer `next_buffer` gave is full: decode what it holds, ask for what comes next."""
        got = self._buf
        self._left -= got.nbytes
        if self._stage == "length":
            (hlen,) = _LEN.unpack_from(got) if got.nbytes == _LEN.size else (-1,)
            if not self._error and _LEN.size + hlen + self._n // 2 != got.nbytes + self._left:
                self._error = f"planes of {hlen} and {self._left - hlen} bytes, chunk of {self._n}"
            self._stage = "high"
            self._next(hlen if not self._error else self._left)
            return
        if self._stage == "high":
            if not self._error:
                self._high = self._decode_high(got)
            self._stage = "low"
        elif not self._error:
            assert self._words is not None and self._high is not None
            at, k = self._at, got.nbytes
            lo = np.frombuffer(got, dtype=np.uint8)
            words = self._words[at : at + k]
            if not _join(self._high[at : at + k], lo, words):
                np.left_shift(self._high[at : at + k], 8, out=words, dtype=np.uint16)
                words |= lo
            self._at += k
        self._next(PIECE)

    def finish(self) -> None:
        """CodedChunkError unless ``out`` now holds the decoded chunk."""
        if self._left > 0:
            raise CodedChunkError(f"{self._left} coded bytes were never received")
        if self._error:
            raise CodedChunkError(self._error)

    def _next(self, want: int) -> None:
        want = min(want, self._left)
        if self._stage != "low":
            self._buf = memoryview(bytearray(want))
            return
        if self._piece is None:
            self._piece = memoryview(bytearray(min(PIECE, self._left)))
        self._buf = self._piece[:want]  # (one buffer for every piece)

    def _decode_high(self, frame: memoryview) -> np.ndarray | None:
        try:
            high = zstandard.ZstdDecompressor().decompress(frame, max_output_size=self._n // 2)
        except zstandard.ZstdError as exc:
            self._error = f"high plane: {exc}"
            return None
        if len(high) != self._n // 2:
            self._error = f"high plane of {len(high)} bytes, chunk of {self._n}"
            return None
        return np.frombuffer(high, dtype=np.uint8)
