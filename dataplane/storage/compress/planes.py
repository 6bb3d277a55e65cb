"""Lossless coding of 16-bit float chunks (bfloat16, float16) for the slower tiers.

A chunk of 16-bit words is split into two byte planes: the high bytes (sign and exponent, and
for float16 two bits of mantissa) and the low bytes (mantissa). The exponents of KV are few and
skewed (about 2.5 to 3 bits of information in bfloat16's 8), so the high plane is entropy-coded
with zstandard (its Huffman coding of literals does the work: matches are searched for little,
which codes as well as level 1 and decodes faster); the low plane is near uniform and is kept as
it is. The chunk is coded in pieces of `PIECE_WORDS` words (the codec `PLANES`, code 2), so
that a reader decodes each piece as it arrives and joins it while its high bytes are in cache:

    piece words         u32   (little-endian, as all fields; the last piece may be shorter)
    for each piece:
      frame length      u32
      high bytes        a zstandard frame of the piece's high bytes
      low bytes         the piece's low bytes, as they are

Servers before pieces wrote the chunk in one piece (code 1, `decode_whole_into`, still read):
a u32 length, one zstandard frame of all n/2 high bytes, then the n/2 low bytes.

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
passes. `StreamDecoder` decodes a chunk while it arrives, piece by piece.
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
# words a piece (1 MiB of chunk): its 512 KiB of high bytes are joined while in cache, and a
# reader decodes a piece while the next arrives. Decoded as fast as one piece of the whole chunk
# (a trained model's KV, 16 MiB: 3.01 GB/s against 3.00; pieces of 128 Ki words: 2.28)
PIECE_WORDS = 1 << 19
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
    """``payload`` (a chunk of ``dtype`` elements) coded in pieces, or None when it
    is stored raw: not a 16-bit float chunk, or not `MIN_SAVING` smaller coded. Runs on a
    tier's writer thread."""
    n = payload.nbytes
    if dtype not in WORD_DTYPES or n < 2 or n % 2:
        return None
    raw = np.frombuffer(payload, dtype=np.uint8)
    high, low = np.empty(n // 2, dtype=np.uint8), np.empty(n // 2, dtype=np.uint8)
    if not _split(raw, high, low):
        high[:] = raw[1::2]  # (little-endian words: the high byte second)
        low[:] = raw[0::2]
    cctx = zstandard.ZstdCompressor(compression_params=_PARAMS)
    parts: list[bytes | memoryview] = [_LEN.pack(PIECE_WORDS)]
    size = _LEN.size
    for at in range(0, n // 2, PIECE_WORDS):
        frame = cctx.compress(high[at : at + PIECE_WORDS].data)
        lo = low[at : at + PIECE_WORDS].data
        parts += (_LEN.pack(len(frame)), frame, lo)
        size += _LEN.size + len(frame) + lo.nbytes
    if size > n * (1 - MIN_SAVING):
        return None
    return b"".join(parts)


def decode_into(coded: memoryview | bytes, out: memoryview) -> None:
    """Decode ``coded`` (in pieces) into ``out`` (the raw chunk's size); CodedChunkError when it
    does not decode to exactly that many bytes."""
    data = memoryview(coded).cast("B")
    dec = StreamDecoder(out, data.nbytes)
    at = 0
    while (want := dec.wanted()) > 0:
        dec.take(data[at : at + want])
        at += want
    dec.finish()


def decode_whole_into(coded: memoryview | bytes, out: memoryview) -> None:
    """Decode ``coded`` (in one piece, as servers before pieces wrote it) into ``out``;
    CodedChunkError when it does not decode to exactly that many bytes."""
    data = memoryview(coded).cast("B")
    n = out.nbytes
    if n % 2 or data.nbytes < _LEN.size:
        raise CodedChunkError(f"{data.nbytes} coded bytes cannot hold a chunk of {n}")
    (hlen,) = _LEN.unpack_from(data)
    if _LEN.size + hlen + n // 2 != data.nbytes:
        raise CodedChunkError(f"planes of {hlen} and {data.nbytes - _LEN.size - hlen} bytes, chunk of {n}")
    high = _high_plane(data[_LEN.size : _LEN.size + hlen], n // 2)
    _join_into(
        high, np.frombuffer(data, dtype=np.uint8, offset=_LEN.size + hlen), np.frombuffer(out, np.uint16)
    )


class StreamDecoder:
    """Decodes a chunk coded in pieces while its bytes arrive: piece by piece, each piece's high bytes
    decoded and joined with its low bytes into ``out`` as soon as they are in (while the next
    piece is on its way, and while the decoded high bytes are still in cache).

    Two ways to feed it: `take` (``wanted`` bytes at a time, from a buffer the caller holds), or
    `next_buffer` / `filled` (it gives the buffer, the caller fills it: a socket's receive).
    Bytes that do not decode are remembered, not raised, so that a receiver takes the whole
    value off its connection and judges its hash first: `finish` raises CodedChunkError for
    them. ``out`` holds the chunk only once `finish` returned."""

    def __init__(self, out: memoryview, nbytes: int) -> None:
        self.out = out
        self._words = np.frombuffer(out, dtype=np.uint16) if out.nbytes % 2 == 0 else None
        self._left = nbytes  # coded bytes still to come
        self._error = "" if self._words is not None else f"a chunk of {out.nbytes} bytes is no 16-bit one"
        self._piece = 0  # words a piece (from the coded chunk's first field)
        self._at = 0  # words decoded so far
        self._stage = "piece"  # the field expected next: "piece", "frame_len", "frame", "low", "rest"
        self._want = min(nbytes, _LEN.size)
        self._high: np.ndarray | None = None  # the piece's high bytes, decoded
        self._bufs: dict[str, memoryview] = {}  # a buffer a stage, reused from piece to piece
        self._buf = memoryview(b"")
        self._dctx = zstandard.ZstdDecompressor()  # (one for every piece)

    def wanted(self) -> int:
        """How many bytes the next field takes (0: the value is all in)."""
        return self._want if self._left > 0 else 0

    def next_buffer(self) -> memoryview | None:
        """Where the next coded bytes go (all of it to be filled); None: the value is all in."""
        if self.wanted() == 0:
            return None
        buf = self._bufs.get(self._stage)
        if buf is None or buf.nbytes < self._want:
            buf = self._bufs[self._stage] = memoryview(bytearray(max(self._want, _LEN.size)))
        self._buf = buf[: self._want]
        return self._buf

    def filled(self) -> None:
        """The buffer `next_buffer` gave is full: decode what it holds."""
        self.take(self._buf)

    def take(self, got: memoryview) -> None:
        """The next `wanted` bytes of the coded chunk."""
        self._left -= got.nbytes
        if self._error:
            self._rest()
        elif self._stage == "piece":
            (self._piece,) = _LEN.unpack_from(got) if got.nbytes == _LEN.size else (0,)
            if not 0 < self._piece <= 1 << 30:
                self._fail(f"pieces of {self._piece} words")
            else:
                self._frame_len()
        elif self._stage == "frame_len":
            (flen,) = _LEN.unpack_from(got) if got.nbytes == _LEN.size else (-1,)
            if not 0 < flen <= self._left - self._piece_words():
                self._fail(
                    f"a frame of {flen} bytes, {self._left} bytes left for a piece of {self._piece_words()}"
                )
            else:
                self._stage, self._want = "frame", flen
        elif self._stage == "frame":
            try:
                self._high = _high_plane(got, self._piece_words(), self._dctx)
            except CodedChunkError as exc:
                self._fail(str(exc))
                return
            self._stage, self._want = "low", self._piece_words()
        else:
            assert self._words is not None and self._high is not None
            k = self._piece_words()
            _join_into(self._high, np.frombuffer(got, dtype=np.uint8), self._words[self._at : self._at + k])
            self._at += k
            self._frame_len()

    def finish(self) -> None:
        """CodedChunkError unless ``out`` now holds the decoded chunk."""
        if self._left > 0:
            raise CodedChunkError(f"{self._left} coded bytes were never received")
        if not self._error and self._words is not None and self._at != self._words.size:
            self._error = f"the pieces hold {self._at} of the chunk's {self._words.size} words"
        if self._error:
            raise CodedChunkError(self._error)

    def _piece_words(self) -> int:
        assert self._words is not None
        return min(self._piece, self._words.size - self._at)

    def _frame_len(self) -> None:
        assert self._words is not None
        if self._at == self._words.size:  # (every word decoded: nothing may follow)
            if self._left:
                self._fail(f"{self._left} bytes past the last piece")
            return
        self._stage, self._want = "frame_len", _LEN.size
        if self._left < _LEN.size:
            self._fail(f"the pieces end at word {self._at} of {self._words.size}")

    def _fail(self, why: str) -> None:
        self._error = self._error or why
        self._rest()

    def _rest(self) -> None:
        self._stage, self._want = "rest", min(self._left, _REST)


_REST = 1 << 20  # a value's bytes past a fault are taken in, unread, this many at a time


class WholeDecoder:
    """A chunk coded in one piece (`decode_whole_into`), received as `StreamDecoder` receives
    one (`next_buffer` / `filled`) but in one buffer, and decoded by `finish` once all in."""

    def __init__(self, out: memoryview, nbytes: int) -> None:
        self.out = out
        self._coded: memoryview | None = memoryview(bytearray(nbytes))
        self._whole = self._coded

    def next_buffer(self) -> memoryview | None:
        buf, self._coded = self._coded, None
        return buf

    def filled(self) -> None:
        return None

    def finish(self) -> None:
        if self._coded is not None:
            raise CodedChunkError(f"{self._coded.nbytes} coded bytes were never received")
        decode_whole_into(self._whole, self.out)


def _high_plane(frame: memoryview, n: int, dctx: zstandard.ZstdDecompressor | None = None) -> np.ndarray:
    """The ``n`` high bytes the zstandard ``frame`` holds; CodedChunkError otherwise."""
    try:
        high = (dctx or zstandard.ZstdDecompressor()).decompress(frame, max_output_size=n)
    except zstandard.ZstdError as exc:
        raise CodedChunkError(f"high plane: {exc}") from None
    if len(high) != n:
        raise CodedChunkError(f"high plane of {len(high)} bytes, {n} expected")
    return np.frombuffer(high, dtype=np.uint8)


def _join_into(high: np.ndarray, low: np.ndarray, words: np.ndarray) -> None:
    if not _join(high, low, words):
        np.left_shift(high, 8, out=words, dtype=np.uint16)  # (two passes: 4.6 GB/s here)
        words |= low


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
        WARMUP.start()  # (idempotent)
        return False
    try:
        kernel(high, low, words)
    except TypeError:
        return False
    return True
