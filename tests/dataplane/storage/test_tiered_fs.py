"""The tiered store over a real file tier: writes behind with pins, staging-only L1, read-ahead
on LOOKUP, reads into L1 (or in place, warm), and no byte of L1 lost when a read fails or ends
past its deadline."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dataplane.storage.fs import FileTier
from dataplane.storage.fs.layout import chunk_path
from dataplane.storage.tiered import TieredStore
from tests.helpers import wait_until
from tests.page_cache import drop_from_page_cache

SCOPE = b"\x07" * 16
CHUNK = 32 << 10
# a chunk whose file a test drops from the page cache: past what the kernel's read-ahead lands
# while a read in place of it is tried (the header's read lands 16 KiB and the try starts the
# next window: a 32 KiB file landed whole then about once in 400 tries here, and was read in
# place)
COLD = 256 << 10


def key(i: int) -> bytes:
    return bytes([i]) * 16


# a read's deadline: what a read queued behind stuck I/O threads waits for before it is a miss,
# and long enough that a read of a small cold file never runs past it while the rest of the suite
# (vLLM engines among it) keeps both cores busy (at 0.3 s one did: a warm read in place a miss)
READ_DEADLINE_S = 2.0


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[FileTier]:
    t = FileTier(str(tmp_path), 1 << 30, timeout_s=READ_DEADLINE_S, io_threads=2)
    t.start()
    yield t
    t.stop()
    t.join()


def store(t: TieredStore, i: int, size: int = CHUNK) -> torch.Tensor:
    buf = t.reserve(size)
    assert buf is not None
    buf.copy_(torch.full((size,), i, dtype=torch.uint8))
    assert t.commit(key(i), buf, scope=SCOPE)
    return buf.clone()


def test_a_committed_chunk_is_written_under_its_scope_and_pinned_until_then(
    fs: FileTier, tmp_path: Path
) -> None:
    t = TieredStore(1 << 20, fs=fs)
    want = store(t, 1)
    assert fs.flush(10)
    assert Path(chunk_path(str(tmp_path), SCOPE, key(1))).is_file()
    assert t.stats().chunks == 1 and t._pinned == 0  # the writer let go of its pin
    t2 = TieredStore(1 << 20, fs=fs)  # another server's L1 over the same tier
    assert t2.prefix_hits([key(1), key(2)], SCOPE) == 1
    wait_until(lambda: t2.stats().chunks == 1, 5, what="the read-ahead into L1")
    assert fs.stats().read_ahead == 1
    (buf,) = t2.acquire_prefix([key(1)], scope=SCOPE)
    assert torch.equal(buf, want) and fs.stats().hits == 1  # read once: by the read-ahead
    t2.release([key(1)])


def test_staging_only_l1_keeps_nothing_once_written_and_reads_back_from_disk(fs: FileTier) -> None:
    t = TieredStore(1 << 20, hot_cache=False, fs=fs)
    want = store(t, 2)
    assert fs.flush(10)
    wait_until(lambda: t.stats().chunks == 0, 5, what="the staged chunk to leave L1")
    (buf,) = t.acquire_prefix([key(2)], scope=SCOPE)
    assert torch.equal(buf, want)
    t.release([key(2)])
    assert t.stats().chunks == 0 and t.stats().used_bytes == 0


def test_an_unhealthy_gate_skips_the_disk(fs: FileTier) -> None:
    healthy = [True]
    t = TieredStore(1 << 20, fs=fs, gate=lambda: healthy[0])
    store(t, 3)
    assert fs.flush(10)
    t.discard([key(3)])
    healthy[0] = False
    before = fs.stats()
    assert t.prefix_hits([key(3)], SCOPE) == 0 and t.acquire_prefix([key(3)], scope=SCOPE) == []
    after = fs.stats()
    assert (after.gets, after.durations) == (before.gets, before.durations)  # not one disk call


def test_a_full_l1_or_a_read_past_its_deadline_loses_no_byte_of_l1(fs: FileTier) -> None:
    t = TieredStore(2 * CHUNK, fs=fs)
    store(t, 4)
    store(t, 5)
    assert fs.flush(10)
    t.discard([key(4)])
    pinned = t.acquire_prefix([key(5)], scope=SCOPE)  # L1: one chunk pinned, room for one
    blocker = t.reserve(CHUNK)  # and that room taken: L1 cannot take chunk 4 now
    assert blocker is not None and len(pinned) == 1
    assert t.acquire_prefix([key(4)], scope=SCOPE) == []  # no room: a miss
    t.abort(blocker)
    used = t.stats().used_bytes
    release = threading.Event()
    for _ in range(2):
        assert fs.io.submit(lambda: release.wait(30))  # both I/O threads stuck
    got = t.acquire_prefix([key(4)], scope=SCOPE)  # queued behind them past its deadline
    assert got == [] and fs.stats().get_failures["timeout"] >= 1
    release.set()
    assert t.stats().used_bytes == used  # the abandoned read never ran: nothing reserved
    assert len(t.acquire_prefix([key(4)], scope=SCOPE)) == 1  # and the disk answers again
    t.release([key(4), key(5)])


def test_a_retrieve_reads_the_chunks_l1_lacks_side_by_side_and_serves_them_in_order(fs: FileTier) -> None:
    t = TieredStore(1 << 20, fs=fs)
    want = [store(t, i) for i in range(10, 16)]
    assert fs.flush(10)
    cold = TieredStore(1 << 20, fs=fs)
    bufs = cold.acquire_prefix([key(i) for i in range(10, 16)] + [key(99)], scope=SCOPE)
    assert len(bufs) == 6 and all(torch.equal(b, w) for b, w in zip(bufs, want, strict=True))
    s = fs.stats()
    assert s.hits == 6 and s.read_ahead == 0  # (read ahead counts a LOOKUP's reads only)
    assert cold.stats().hits == 0  # the file tier's hits, not L1's
    cold.release([key(i) for i in range(10, 16)])
    assert len(cold.acquire_prefix([key(10), key(11)], scope=SCOPE)) == 2  # in L1 now
    assert cold.stats().hits == 2 and fs.stats().hits == 6
    cold.release([key(10), key(11)])


def damage(path: str) -> None:
    """Change the last byte of a chunk file."""
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\xee")


def test_a_warm_file_is_read_in_place_then_promoted_a_cold_one_staged_in_l1(
    fs: FileTier, tmp_path: Path
) -> None:
    t = TieredStore(1 << 20, fs=fs)
    want = [store(t, i, COLD) for i in (20, 21, 22)]
    assert fs.flush(10)
    keys = [key(i) for i in (20, 21, 22, 98)]
    for k in keys[:3]:
        Path(chunk_path(str(tmp_path), SCOPE, k)).read_bytes()  # warm
    drop_from_page_cache(chunk_path(str(tmp_path), SCOPE, keys[1]))  # but for the second
    cold = TieredStore(1 << 20, fs=fs)
    dest = [torch.zeros(COLD, dtype=torch.uint8) for _ in keys]
    asked: list[tuple[int, int]] = []

    def into(i: int, n: int) -> list[memoryview]:
        asked.append((i, n))
        half = n // 2  # (two pieces: views need not be one run)
        return [dest[i][:half].numpy().data.cast("B"), dest[i][half:].numpy().data.cast("B")]

    got = cold.acquire_into(keys, into, scope=SCOPE)
    assert len(got) == 3 and got[0] is None and got[1] is not None and got[2] is not None
    assert asked == [(0, COLD), (1, COLD)]  # the second was not in memory: staged from there on
    assert torch.equal(dest[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    s = fs.stats()
    assert s.read_in_place == 1 and s.hits == 3
    cold.release(keys[1:3])
    wait_until(lambda: fs.stats().promoted == 1, 5, what="the chunk read in place to reach L1")
    assert cold.prefix_hits(keys, SCOPE) == 3 and cold.stats().chunks == 3
    (buf,) = cold.acquire_prefix(keys[:1], scope=SCOPE)
    assert torch.equal(buf, want[0])
    cold.release(keys[:1])


def test_a_damaged_warm_file_is_never_reported_read_in_place(fs: FileTier, tmp_path: Path) -> None:
    t = TieredStore(1 << 20, fs=fs)
    store(t, 23)
    assert fs.flush(10)
    path = chunk_path(str(tmp_path), SCOPE, key(23))
    damage(path)
    cold = TieredStore(1 << 20, fs=fs)
    dest = torch.zeros(CHUNK, dtype=torch.uint8)
    got = cold.acquire_into([key(23)], lambda i, n: [dest.numpy().data.cast("B")], scope=SCOPE)
    assert got == [] and fs.stats().bad_files == {"checksum": 1} and fs.stats().read_in_place == 0
    wait_until(lambda: not os.path.exists(path), 5, what="the damaged file removed")


def test_a_cold_last_chunk_lands_in_l1_and_in_place_as_it_is_read(fs: FileTier, tmp_path: Path) -> None:
    t = TieredStore(1 << 20, fs=fs)
    want = store(t, 24, COLD)
    assert fs.flush(10)
    drop_from_page_cache(chunk_path(str(tmp_path), SCOPE, key(24)))
    cold = TieredStore(1 << 20, fs=fs)
    dest = torch.zeros(COLD, dtype=torch.uint8)
    third = COLD // 3
    views = [dest[:third].numpy().data.cast("B"), dest[third:].numpy().data.cast("B")]
    assert cold.acquire_into([key(24)], lambda i, n: views, scope=SCOPE) == [None]
    assert torch.equal(dest, want)
    s = fs.stats()
    assert (s.hits, s.read_in_place, s.promoted) == (1, 0, 0)  # read once, through L1
    assert cold.stats().chunks == 1 and cold._pinned == 0  # in L1 already, nothing held
    dest.zero_()
    (buf,) = cold.acquire_into([key(24)], lambda i, n: views, scope=SCOPE)  # from L1 now: pinned
    assert buf is not None and torch.equal(buf, want) and not dest.any()
    cold.release([key(24)])


def test_a_damaged_or_late_cold_chunk_is_a_miss_and_l1_loses_no_byte(fs: FileTier, tmp_path: Path) -> None:
    t = TieredStore(1 << 20, fs=fs)
    store(t, 25)
    store(t, 26)
    assert fs.flush(10)
    path = chunk_path(str(tmp_path), SCOPE, key(25))
    damage(path)
    drop_from_page_cache(path)
    cold = TieredStore(1 << 20, fs=fs)
    dest = torch.zeros(CHUNK, dtype=torch.uint8)
    views = lambda i, n: [dest.numpy().data.cast("B")]  # noqa: E731
    assert cold.acquire_into([key(25)], views, scope=SCOPE) == []
    assert fs.stats().bad_files == {"checksum": 1} and cold.stats().used_bytes == 0
    wait_until(lambda: not os.path.exists(path), 5, what="the damaged file removed")
    drop_from_page_cache(chunk_path(str(tmp_path), SCOPE, key(26)))
    release = threading.Event()
    for _ in range(2):
        assert fs.io.submit(lambda: release.wait(30))  # both I/O threads stuck
    assert cold.acquire_into([key(26)], views, scope=SCOPE) == []  # past its deadline: a miss
    assert fs.stats().get_failures["timeout"] >= 1 and cold.stats().used_bytes == 0
    release.set()
    # the late read still runs and warms the page cache (a warm file is read in place, not
    # through L1): let it end, then make the file cold again
    wait_until(lambda: fs.io.pending() == 0 and fs.io.stalled_for() == 0, 10, what="the late read over")
    drop_from_page_cache(chunk_path(str(tmp_path), SCOPE, key(26)))
    assert cold.acquire_into([key(26)], views, scope=SCOPE) == [None]  # the disk answers again
    assert cold.stats().used_bytes == CHUNK
