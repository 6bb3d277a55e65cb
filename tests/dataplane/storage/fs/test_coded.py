"""The file tier with ``compression="lossless"``: bfloat16 chunks written coded on the writer
thread, read back bit for bit by every read path (a coded file is decoded, never read in place),
a damaged coded file a counted miss, other dtypes and chunks that do not shrink stored raw."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dataplane.storage.fs import FileTier
from dataplane.storage.fs.layout import PAYLOAD_AT, chunk_path
from tests.dataplane.storage.fs.test_tier import SCOPE, Bufs, key, read
from tests.helpers import wait_until

CHUNK = 64 << 10


def kv_like(i: int, n: int = CHUNK) -> bytes:
    """bfloat16 values of a narrow range, as KV is: their exponent bytes code well."""
    x = np.random.default_rng(i).normal(0, 1, n // 2).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()


@pytest.fixture
def coded(tmp_path: Path) -> Iterator[FileTier]:
    t = FileTier(str(tmp_path), 1 << 30, timeout_s=2.0, compression="lossless")
    t.start()
    yield t
    t.stop()
    t.join()


def put(t: FileTier, i: int, data: bytes, words: str | None = "bfloat16") -> None:
    done = threading.Event()
    assert t.put(SCOPE, key(i), memoryview(data), done.set, words=words)
    assert t.flush(10) and done.is_set()


def test_a_coded_chunk_is_smaller_on_disk_and_reads_back_bit_for_bit(coded: FileTier, tmp_path: Path) -> None:
    put(coded, 1, kv_like(1))
    path = Path(chunk_path(str(tmp_path), SCOPE, key(1)))
    assert path.stat().st_size < PAYLOAD_AT + CHUNK / 1.2
    s = coded.stats()
    assert s.coded_puts == 1 and s.coded_bytes_saved == CHUNK + PAYLOAD_AT - path.stat().st_size
    assert s.used_bytes == path.stat().st_size  # (the cap counts the coded bytes)
    assert read(coded, 1) == kv_like(1)


def test_every_read_path_decodes_a_coded_file(coded: FileTier) -> None:
    put(coded, 2, kv_like(2))
    want = kv_like(2)
    # in place: refused (a coded file is decoded), so the caller reads it the staged way
    dest = bytearray(CHUNK)
    assert coded.get_into(SCOPE, key(2), CHUNK, lambda n: [memoryview(dest)]) is False
    assert coded.get_many_into(SCOPE, [key(2), key(2)], CHUNK, lambda i: [memoryview(bytearray(CHUNK))]) == [
        False
    ]
    # followed: the views get the decoded chunk once it is whole
    b = Bufs()
    views = [memoryview(bytearray(CHUNK // 4)) for _ in range(4)]
    got = coded.get_through(SCOPE, key(2), CHUNK, b.alloc, b.give_back, lambda n: views)
    assert got is not None and got[1] and bytes(got[0]) == want
    assert b"".join(bytes(v) for v in views) == want
    assert coded.stats().read_in_place == 0


def test_a_damaged_coded_file_is_a_counted_miss_and_removed(coded: FileTier, tmp_path: Path) -> None:
    put(coded, 3, kv_like(3))
    path = Path(chunk_path(str(tmp_path), SCOPE, key(3)))
    data = bytearray(path.read_bytes())
    data[PAYLOAD_AT + 100] ^= 0x40
    path.write_bytes(bytes(data))
    assert read(coded, 3) is None
    assert coded.stats().bad_files == {"checksum": 1}
    wait_until(lambda: not path.exists(), 5, what="the damaged file removed")


def test_other_dtypes_and_chunks_that_do_not_shrink_are_stored_raw(coded: FileTier, tmp_path: Path) -> None:
    put(coded, 4, kv_like(4), words="uint8")  # int8 chunks and other bytes: as they are
    noise = np.random.default_rng(5).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()
    put(coded, 5, noise)  # bfloat16 of random bits: saves under 5%
    for i, data in ((4, kv_like(4)), (5, noise)):
        assert Path(chunk_path(str(tmp_path), SCOPE, key(i))).stat().st_size == PAYLOAD_AT + CHUNK
        assert read(coded, i) == data
    assert coded.stats().coded_puts == 0


def test_a_tier_that_does_not_code_reads_coded_files(tmp_path: Path) -> None:
    t = FileTier(str(tmp_path), 1 << 30, timeout_s=2.0, compression="lossless")
    t.start()
    put(t, 6, kv_like(6))
    t.stop()
    t.join()
    plain = FileTier(str(tmp_path), 1 << 30, timeout_s=2.0)
    plain.start()
    try:
        assert read(plain, 6) == kv_like(6)
        put(plain, 7, kv_like(7))  # (written raw)
        assert Path(chunk_path(str(tmp_path), SCOPE, key(7))).stat().st_size == PAYLOAD_AT + CHUNK
    finally:
        plain.stop()
        plain.join()


def test_an_unknown_setting_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="compression 'zstd'"):
        FileTier(str(tmp_path), 1 << 30, compression="zstd")
