"""Compressed chunks: the codecs a tier may store a chunk in, named by the code its header
carries (`dataplane.storage.codec`). ``NONE``: the chunk's bytes as they are. ``PLANES``:
16-bit float chunks coded losslessly in pieces (`planes`), by the file and remote tiers' writer
threads. ``PLANES_WHOLE``: the same coding in one piece, as servers before pieces wrote it:
still read, never written."""

from __future__ import annotations

from dataplane.storage.compress import planes
from dataplane.storage.compress.planes import (
    WARMUP,
    WORD_DTYPES,
    CodedChunkError,
    StreamDecoder,
    WholeDecoder,
)

NONE = 0
PLANES_WHOLE = 1
PLANES = 2
# code -> name (the codes are stable: written into values)
CODECS = {NONE: "none", PLANES_WHOLE: "planes (whole)", PLANES: "planes"}
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
    coded = planes.encode(payload, dtype)
    return None if coded is None else (PLANES, coded)


def decode_into(codec: int, coded: memoryview | bytes, out: memoryview) -> None:
    """Decode ``coded`` (of ``codec``) into ``out``; CodedChunkError when it does not decode."""
    if codec == PLANES:
        planes.decode_into(coded, out)
    elif codec == PLANES_WHOLE:
        planes.decode_whole_into(coded, out)
    else:
        raise CodedChunkError(f"unknown codec {codec}")


def stream_decoder(codec: int, out: memoryview, nbytes: int) -> StreamDecoder | WholeDecoder:
    """A decoder of ``nbytes`` coded bytes (of ``codec``) into ``out`` as they arrive
    (`StreamDecoder`; `WholeDecoder` for the codec in one piece); CodedChunkError for a codec it
    does not know."""
    if codec == PLANES:
        return StreamDecoder(out, nbytes)
    if codec == PLANES_WHOLE:
        return WholeDecoder(out, nbytes)
    raise CodedChunkError(f"unknown codec {codec}")


__all__ = [
    "CODECS",
    "LOSSLESS_SETTINGS",
    "NONE",
    "PLANES",
    "PLANES_WHOLE",
    "WARMUP",
    "WORD_DTYPES",
    "CodedChunkError",
    "StreamDecoder",
    "WholeDecoder",
    "checked_setting",
    "decode_into",
    "encode",
    "stream_decoder",
]
