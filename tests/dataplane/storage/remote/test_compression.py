"""The remote tier's lossless coding against a real redis-server: a 16-bit float chunk is stored
coded (fewer bytes in Redis) and read back bit-exact, into the caller's buffer; other dtypes and
the setting "none" store chunks as they are; any reader decodes any writer's; a damaged coded
value is a counted miss."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from dataplane.storage import codec, compress
from dataplane.storage.codec import header_size
from dataplane.storage.compress import planes
from dataplane.storage.compress.planes import encode
from dataplane.storage.remote import RemoteBackend, direct
from tests.redis_server import RedisServer

N = 256 << 10  # a 256 KiB chunk (uint8 x N, as the tiers file it)


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _kv(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N // 128, 64, generator=g) * torch.rand(64, generator=g) * 3
    return bytes(x.to(torch.bfloat16).view(torch.uint8).numpy())


def _backend(url: str, compression: str = "lossless") -> RemoteBackend:
    b = RemoteBackend(url, timeout_s=5.0, compression=compression)
    b.start()
    return b


@pytest.fixture
def backends(redis_server: RedisServer) -> Iterator[dict[str, RemoteBackend]]:
    made = {c: _backend(redis_server.url, c) for c in ("lossless", "none")}
    try:
        yield made
    finally:
        for b in made.values():
            b.stop()
            b.join(10)
            b.close()


def _stored(redis_server: RedisServer, b: RemoteBackend, key: bytes) -> int:
    c = redis_server.client()
    try:
        return int(c.strlen(b.redis_key(key)))
    finally:
        c.close()


@pytest.mark.parametrize("pieces", ["one piece, one range", "many pieces across many ranges"])
def test_a_bf16_chunk_is_stored_coded_and_read_back_exactly(
    redis_server: RedisServer,
    backends: dict[str, RemoteBackend],
    pieces: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if pieces.startswith("many"):  # (pieces of 16 KiB of chunk, read in ranges that cut them)
        monkeypatch.setattr(planes, "PIECE_WORDS", 1 << 13)
        monkeypatch.setattr(direct, "RANGE", 50_000)
    b = backends["lossless"]
    raw = _kv(1)
    assert b.put(_key(1), "uint8", (N,), memoryview(raw), words="bfloat16") and b.flush(10)
    held = _stored(redis_server, b, _key(1)) - header_size(1)
    assert N / held > 1.3, N / held  # random KV-like bf16: about 1.45x
    s = b.stats()
    assert s.coded_puts == 1 and s.coded_bytes_saved == N - held and s.bytes_written == held + header_size(1)
    got = b.get(_key(1), "uint8", (N,))
    assert got is not None and bytes(got) == raw
    dest = bytearray(N)  # into the caller's buffer (an L1 buffer, in a server)
    given: list[int] = []

    def alloc(n: int) -> memoryview:
        given.append(n)
        return memoryview(dest)

    got = b.get(_key(1), "uint8", (N,), alloc=alloc)
    assert got is not None and given == [N] and bytes(dest) == raw
    # a server with compression "none" reads it too: the header names the codec
    other = backends["none"].get(_key(1), "uint8", (N,))
    assert other is not None and bytes(other) == raw


def test_other_dtypes_and_the_setting_none_store_chunks_as_they_are(
    redis_server: RedisServer, backends: dict[str, RemoteBackend]
) -> None:
    raw = _kv(2)
    lossless, none = backends["lossless"], backends["none"]
    assert lossless.put(_key(2), "uint8", (N,), memoryview(raw), words="float8_e4m3fn")
    assert lossless.put(_key(3), "uint8", (N,), memoryview(raw))  # (no dtype named: raw)
    assert none.put(_key(4), "uint8", (N,), memoryview(raw), words="bfloat16")
    assert lossless.flush(10) and none.flush(10)
    for b, k in ((lossless, 2), (lossless, 3), (none, 4)):
        assert _stored(redis_server, b, _key(k)) == header_size(1) + N
        got = lossless.get(_key(k), "uint8", (N,))
        assert got is not None and bytes(got) == raw
    assert lossless.stats().coded_puts == 0 and none.stats().coded_puts == 0


def test_a_damaged_coded_value_is_a_counted_miss(
    redis_server: RedisServer, backends: dict[str, RemoteBackend]
) -> None:
    b = backends["lossless"]
    assert b.put(_key(5), "uint8", (N,), memoryview(_kv(5)), words="bfloat16") and b.flush(10)
    c = redis_server.client()
    try:
        name = b.redis_key(_key(5))
        at = int(c.strlen(name)) - 10
        c.setrange(name, at, bytes([c.getrange(name, at, at)[0] ^ 0xFF]))
    finally:
        c.close()
    assert b.get(_key(5), "uint8", (N,)) is None
    assert b.stats().bad_values == {"checksum": 1}


def test_an_unknown_compression_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="compression 'zip': one of none, lossless"):
        RemoteBackend("redis://127.0.0.1:1/0", compression="zip")


def test_a_forged_coded_value_that_does_not_decode_gives_its_buffer_back_and_reads_go_on(
    redis_server: RedisServer, backends: dict[str, RemoteBackend]
) -> None:
    """A value whose hash holds but whose planes do not decode (a faulty coder's): a "format"
    miss, the buffer handed out for it given back, the connection left clean for the next read."""
    b = backends["lossless"]
    raw = _kv(6)
    assert b.put(_key(6), "uint8", (N,), memoryview(raw), words="bfloat16") and b.flush(10)
    coded = encode(memoryview(raw), "bfloat16")
    assert coded is not None
    junk = bytearray(coded)
    junk[4:12] = b"notzstd!"  # (the frame's magic)
    c = redis_server.client()
    try:
        c.set(b.redis_key(_key(7)), codec.encode(_key(7), "uint8", (N,), bytes(junk), codec=compress.PLANES))
    finally:
        c.close()
    dest, given, back = bytearray(N), [], []

    def alloc(n: int) -> memoryview:
        given.append(n)
        return memoryview(dest)

    for _ in range(2):  # (the second read goes over the connection the first left)
        assert b.get(_key(7), "uint8", (N,), alloc=alloc, give_back=back.append) is None
        got = b.get(_key(6), "uint8", (N,), alloc=alloc, give_back=back.append)
        assert got is not None and bytes(dest) == raw
    assert b.stats().bad_values == {"format": 2}
    assert given == [N] * 4 and len(back) == 2  # (each forged read's buffer, given back)
