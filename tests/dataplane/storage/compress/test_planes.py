"""The lossless codec of 16-bit float chunks: bit-exact round trips, what it declines to code,
and coded bytes that do not decode (a clear error, never wrong bytes)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from dataplane.storage import compress
from dataplane.storage.compress import planes
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
    with pytest.raises(CodedChunkError, match="bytes left for a piece"):
        decode_into(coded[:-1], out)  # truncated
    with pytest.raises(CodedChunkError):
        decode_into(coded, memoryview(bytearray(raw.nbytes + 2)))  # another chunk size
    bad = bytearray(coded)
    bad[10] ^= 0xFF  # inside the first zstandard frame's header
    with pytest.raises(CodedChunkError, match="high plane"):
        decode_into(bytes(bad), out)
    with pytest.raises(CodedChunkError, match="past the last piece"):
        decode_into(coded + b"\0", out)
    with pytest.raises(CodedChunkError, match="unknown codec"):
        compress.decode_into(7, coded, out)


def numpy_only(coded: bytes, n: int) -> bytes:
    """``coded`` decoded by numpy's passes alone (as before the kernels are compiled)."""
    with planes.numpy_passes():
        return back(coded, n)


@pytest.fixture
def kernels() -> None:
    planes.WARMUP.start()
    planes.WARMUP.join(300.0)
    assert planes.WARMUP.state == "ready", planes.WARMUP.state


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_compiled_planes_agree_with_numpys_bit_for_bit(kernels: None, dtype: torch.dtype) -> None:
    raw = kv_like(1 << 16, dtype, seed=3)
    name = str(dtype).removeprefix("torch.")
    coded = encode(raw, name)
    assert coded is not None
    with planes.numpy_passes():
        assert encode(raw, name) == coded  # numpy's split codes the same bytes
    assert back(coded, raw.nbytes) == bytes(raw) == numpy_only(coded, raw.nbytes)
    assert back(bytes(bytearray(coded)), raw.nbytes) == bytes(raw)  # read-only planes
    assert back(bytearray(coded), raw.nbytes) == bytes(raw)  # writable planes


def test_unaligned_buffers_take_numpys_path_and_stay_exact(kernels: None) -> None:
    raw = kv_like(1 << 14, torch.bfloat16, seed=4)
    shifted = bytearray(raw.nbytes + 1)
    shifted[1:] = raw
    coded = encode(memoryview(shifted)[1:], "bfloat16")  # an odd address: not the kernel's
    assert coded is not None and coded == encode(raw, "bfloat16")
    out = bytearray(raw.nbytes + 1)
    decode_into(coded, memoryview(out)[1:])
    assert bytes(out[1:]) == bytes(raw)


FIRST_READ = """
import numpy as np
from dataplane.storage.compress import planes
raw = (np.random.default_rng(0).standard_normal(1 << 14).astype(np.float32).view(np.uint32) >> 16)
raw = raw.astype(np.uint16).view(np.uint8)
coded = planes.encode(memoryview(raw), "bfloat16")
assert planes.WARMUP.state == "idle", planes.WARMUP.state  # (encoding alone compiles nothing)
out = bytearray(raw.nbytes)
planes.decode_into(coded, memoryview(out))  # numpy's passes, and the compile begins
assert bytes(out) == raw.tobytes()
assert planes.WARMUP.state in ("compiling", "ready"), planes.WARMUP.state
planes.WARMUP.join(300.0)
assert planes.WARMUP.state == "ready", planes.WARMUP.state
planes.decode_into(coded, memoryview(out))
assert bytes(out) == raw.tobytes()
"""


def test_the_first_coded_read_of_a_process_starts_the_compile() -> None:
    done = subprocess.run([sys.executable, "-c", FIRST_READ], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def stream(coded: bytes, out: memoryview, early: int = 0) -> planes.StreamDecoder:
    """``coded`` received through a decoder as the remote tier receives it: ``early`` bytes come
    with the header, the rest fills each buffer it asks for."""
    dec = planes.StreamDecoder(out, len(coded))
    at, pending = 0, memoryview(coded)[:early]
    while (buf := dec.next_buffer()) is not None:
        k = min(pending.nbytes, buf.nbytes)
        buf[:k] = pending[:k]
        pending = pending[k:]
        buf[k:] = coded[at + k : at + buf.nbytes]
        at += buf.nbytes
        dec.filled()
    assert at == len(coded)  # (all of it asked for, whatever it held)
    return dec


@pytest.mark.parametrize("early", [0, 3, 40])
@pytest.mark.parametrize("with_kernels", [True, False])
def test_the_stream_decoder_decodes_pieces_as_they_arrive(
    kernels: None, early: int, with_kernels: bool
) -> None:
    raw = kv_like((3 * planes.PIECE_WORDS + 4096) // 2, torch.bfloat16, seed=7)  # (several pieces)
    coded = encode(raw, "bfloat16")
    assert coded is not None
    out = bytearray(raw.nbytes)
    if with_kernels:
        stream(coded, memoryview(out), early).finish()
    else:
        with planes.numpy_passes():
            stream(coded, memoryview(out), early).finish()
    assert bytes(out) == bytes(raw)


def test_the_stream_decoder_takes_in_every_byte_of_a_bad_value_then_raises() -> None:
    raw = kv_like(1 << 15, torch.bfloat16, seed=8)
    coded = encode(raw, "bfloat16")
    assert coded is not None
    bad = bytearray(coded)
    bad[10] ^= 0xFF  # inside the first zstandard frame's header
    with pytest.raises(CodedChunkError, match="high plane"):
        stream(bytes(bad), memoryview(bytearray(raw.nbytes))).finish()
    bad = bytearray(coded)
    bad[4:8] = (1 << 31).to_bytes(4, "little")  # a frame longer than the value
    with pytest.raises(CodedChunkError, match="a frame of"):
        stream(bytes(bad), memoryview(bytearray(raw.nbytes))).finish()
    with pytest.raises(CodedChunkError, match="a frame of"):  # pieces that do not add up
        stream(coded, memoryview(bytearray(raw.nbytes + 2))).finish()
    with pytest.raises(CodedChunkError, match="16-bit"):
        stream(coded, memoryview(bytearray(raw.nbytes + 1))).finish()
    dec = planes.StreamDecoder(memoryview(bytearray(raw.nbytes)), len(coded))
    with pytest.raises(CodedChunkError, match="never received"):
        dec.finish()


def whole(raw: memoryview) -> bytes:
    """``raw`` coded in one piece, as servers before pieces wrote it."""
    import zstandard

    b = np.frombuffer(raw, dtype=np.uint8)
    frame = zstandard.ZstdCompressor().compress(np.ascontiguousarray(b[1::2]).data)
    return len(frame).to_bytes(4, "little") + frame + np.ascontiguousarray(b[0::2]).tobytes()


def test_chunks_coded_in_one_piece_by_older_servers_are_still_read() -> None:
    raw = kv_like(planes.PIECE_WORDS + 1000, torch.bfloat16, seed=9)
    old = whole(raw)
    out = bytearray(raw.nbytes)
    compress.decode_into(compress.PLANES_WHOLE, old, memoryview(out))
    assert bytes(out) == bytes(raw)
    out = bytearray(raw.nbytes)
    dec = compress.stream_decoder(compress.PLANES_WHOLE, memoryview(out), len(old))
    while (buf := dec.next_buffer()) is not None:
        buf[:] = old
        dec.filled()
    dec.finish()
    assert bytes(out) == bytes(raw)
    with pytest.raises(CodedChunkError):  # (and either format read as the other fails)
        compress.decode_into(compress.PLANES, old, memoryview(out))
    with pytest.raises(CodedChunkError):
        compress.decode_into(compress.PLANES_WHOLE, encode(raw, "bfloat16") or b"", memoryview(out))


def test_a_chunk_is_coded_in_pieces_of_a_fixed_size_the_last_shorter() -> None:
    words = 2 * planes.PIECE_WORDS + 12352  # (a whole number of 64-word rows)
    raw = kv_like(words, torch.bfloat16, seed=10)
    coded = encode(raw, "bfloat16")
    assert coded is not None
    assert int.from_bytes(coded[:4], "little") == planes.PIECE_WORDS
    at, lows = 4, []
    while at < len(coded):
        flen = int.from_bytes(coded[at : at + 4], "little")
        k = min(planes.PIECE_WORDS, words - sum(lows))
        at += 4 + flen + k
        lows.append(k)
    assert at == len(coded) and lows == [planes.PIECE_WORDS, planes.PIECE_WORDS, 12352]
