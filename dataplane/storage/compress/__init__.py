"""Compressed chunks: the codecs a tier may store a chunk in, named by the code its header
carries (`dataplane.storage.codec`). ``NONE``: the chunk's bytes as they are. ``PLANES``:
16-bit float chunks coded losslessly (`planes`), by the file and remote tiers' writer threads."""

from __future__ import annotations

from dataplane.storage.compress.planes import WARMUP, WORD_DTYPES, CodedChunkError, StreamDecoder
from dataplane.storage.compress.planes import decode_into as _planes_decode
from dataplane.storage.compress.planes import encode as _planes_encode

NONE = 0
PLANES = 1
CODECS = {NONE: "none", PLANES: "planes"}  # code -> name (stable: written into values)
LOSSLESS_SETTINGS = ("none", "lossless")  # a tier's `--*-compression`


def checked_setting(setting: str) -> str:
    """``setting`` if it is one of `LOSSLESS_SETTINGS`, else ValueError naming them."""
    if setting not in LOSSLESS_SETTINGS:
        raise ValueError(f"compression {setting!r}: one of {', '.join(LOSSLESS_SETTINGS)}")
    return setting


def encode(payload: memoryview, dtype: str | None, setting: str) -> tuple[int, bytes] | None:
    """(codec, coded bytes) of ``payload`` under a tier's ``setting``, or None: stored raw (the
    setting is "none", or the codec does not pay for this chunk)."""
    if setting != "lossless":
        return None
    coded = _planes_encode(payload, dtype)
    return None if coded is None else (PLANES, coded)


def decode_into(codec: int, coded: memoryview | bytes, out: memoryview) -> None:
    """Decode ``coded`` (of ``codec``) into ``out``; CodedChunkError when it does not decode."""
    if codec != PLANES:
        raise CodedChunkError(f"unknown codec {codec}")
    _planes_decode(coded, out)


def stream_decoder(codec: int, out: memoryview, nbytes: int) -> StreamDecoder:
    """A decoder of ``nbytes`` coded bytes (of ``codec``) into ``out`` as they arrive
    (`StreamDecoder`); CodedChunkError for a codec it does not know."""
    if codec != PLANES:
        raise CodedChunkError(f"unknown codec {codec}")
    return StreamDecoder(out, nbytes)


__all__ = [
    "CODECS",
    "LOSSLESS_SETTINGS",
    "NONE",
    "PLANES",
    "WARMUP",
    "WORD_DTYPES",
    "CodedChunkError",
    "StreamDecoder",
    "checked_setting",
    "decode_into",
    "encode",
    "stream_decoder",
]
