"""The remote value format: round trips, and every kind of damaged or foreign value refused."""

from __future__ import annotations

import os

import pytest

from dataplane.storage.codec import RemoteValueError, decode, encode, encode_header, header_size

KEY = b"kvw:m:1:0:abc"
SHAPE = (2, 16, 64)  # bfloat16: 4,096 bytes
PAYLOAD = os.urandom(2 * 16 * 64 * 2)


def _kind(value: bytes, key: bytes = KEY, **expect: object) -> str:
    with pytest.raises(RemoteValueError) as e:
        decode(key, value, **expect)  # type: ignore[arg-type]
    return e.value.kind


def test_round_trip_returns_a_view_of_the_payload() -> None:
    value = encode(KEY, "bfloat16", SHAPE, PAYLOAD)
    assert len(value) == header_size(3) + len(PAYLOAD)
    dtype, shape, payload = decode(KEY, value, "bfloat16", SHAPE)
    assert (dtype, shape, bytes(payload)) == ("bfloat16", SHAPE, PAYLOAD)
    assert payload.obj is not None and payload.nbytes == len(PAYLOAD)  # a view, no copy


def test_header_then_payload_is_the_same_value() -> None:
    assert encode_header(KEY, "bfloat16", SHAPE, memoryview(PAYLOAD)) + PAYLOAD == encode(
        KEY, "bfloat16", SHAPE, PAYLOAD
    )


@pytest.mark.parametrize("cut", [0, 3, 20, header_size(3) - 1, header_size(3) + 1, -1])
def test_truncated_values_are_refused(cut: int) -> None:
    value = encode(KEY, "bfloat16", SHAPE, PAYLOAD)
    assert _kind(value[:cut]) == "truncated"


def test_every_single_flipped_byte_is_refused() -> None:
    value = bytearray(encode(KEY, "bfloat16", (2, 64), PAYLOAD[: 2 * 64 * 2]))
    kinds = set()
    for i in range(len(value)):
        damaged = bytearray(value)
        damaged[i] ^= 0x01
        kinds.add(_kind(bytes(damaged)))
    assert kinds <= {"format", "truncated", "checksum"} and "checksum" in kinds


def test_another_keys_value_is_refused() -> None:
    other = encode(b"kvw:m:1:0:def", "bfloat16", SHAPE, PAYLOAD)
    assert _kind(other) == "key"


def test_foreign_values_are_refused() -> None:
    assert _kind(b"just a string someone SET here, long enough for a header") == "format"
    assert _kind(b"") == "truncated"
    value = bytearray(encode(KEY, "bfloat16", SHAPE, PAYLOAD))
    value[4] = 99  # another format version
    assert _kind(bytes(value)) == "format"


def test_a_value_of_another_layout_is_refused_when_the_reader_knows_its_own() -> None:
    value = encode(KEY, "bfloat16", SHAPE, PAYLOAD)
    assert _kind(value, dtype="float16", shape=SHAPE) == "layout"
    assert _kind(value, dtype="bfloat16", shape=(4, 16, 32)) == "layout"


def test_bad_encode_arguments_name_the_problem() -> None:
    with pytest.raises(ValueError, match="no remote format code"):
        encode(KEY, "complex64", SHAPE, PAYLOAD)
    with pytest.raises(ValueError, match="is not bfloat16"):
        encode(KEY, "bfloat16", (3, 16, 64), PAYLOAD)
    with pytest.raises(ValueError, match="dimensions"):
        encode(KEY, "uint8", (), b"")


# ---------------------------------------------------------------- coded payloads


def _coded() -> tuple[bytes, bytes]:
    """A KV-like bfloat16 chunk of 64 KiB (uint8 x n, as the tiers file it) and its coding."""
    import torch

    from dataplane.storage import compress

    g = torch.Generator().manual_seed(3)
    raw = bytes((torch.randn(1 << 15, generator=g).to(torch.bfloat16)).view(torch.uint8).numpy())
    got = compress.encode(memoryview(raw), "bfloat16", "lossless")
    assert got is not None and got[0] == compress.PLANES
    return raw, got[1]


def test_a_coded_value_is_version_2_and_decodes_to_the_chunk() -> None:
    from dataplane.storage.compress import PLANES

    raw, coded = _coded()
    value = encode(KEY, "uint8", (len(raw),), coded, PLANES)
    assert value[4] == 2 and value[7] == PLANES and len(value) == header_size(1) + len(coded)
    dtype, shape, payload = decode(KEY, value, "uint8", (len(raw),))
    assert (dtype, shape, bytes(payload)) == ("uint8", (len(raw),), raw)
    plain = encode(KEY, "uint8", (len(raw),), raw)
    assert plain[4] == 1 and plain[7] == 0  # a raw value stays version 1, as before codecs


def test_coded_values_that_are_damaged_or_foreign_are_refused() -> None:
    from dataplane.storage.compress import PLANES

    raw, coded = _coded()
    value = bytearray(encode(KEY, "uint8", (len(raw),), coded, PLANES))
    bad = bytearray(value)
    bad[-1] ^= 1  # a byte of the low plane
    assert _kind(bytes(bad)) == "checksum"
    assert _kind(bytes(value), key=b"another") == "key"
    v1 = bytearray(value)
    v1[4] = 1  # a codec in a version-1 value: not one this format has
    assert _kind(bytes(v1)) == "format"
    v9 = bytearray(value)
    v9[7] = 9  # an unknown codec
    assert _kind(bytes(v9)) == "format"
    with pytest.raises(ValueError, match="coded payload"):
        encode(KEY, "uint8", (len(raw),), raw, PLANES)  # "coded" but no smaller: refused at write


def test_a_coded_payload_with_a_sound_hash_that_does_not_decode_is_format() -> None:
    from dataplane.storage.compress import PLANES

    raw, coded = _coded()
    broken = coded[:4] + bytes(len(coded) - 4)  # the planes' lengths, then zeros: no zstd frame
    assert _kind(encode(KEY, "uint8", (len(raw),), broken, PLANES)) == "format"
