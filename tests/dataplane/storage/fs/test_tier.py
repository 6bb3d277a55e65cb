"""The file tier on a real directory: layout, whole-file publication under concurrent writers,
the index and its rebuild, LRU eviction under the cap, stale temporary files, bad files, and
disk calls past their deadline (threads really blocked)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dataplane.storage.codec import encode
from dataplane.storage.fs import FileTier, chunk_file
from dataplane.storage.fs.disk import DiskBusy, DiskPool, DiskTimeout
from dataplane.storage.fs.index import FileIndex
from dataplane.storage.fs.layout import FORMAT_DIR, HOST, PAYLOAD_AT, STALE_TMP_S, chunk_path
from dataplane.storage.lower import OK, TIMEOUT
from tests.helpers import wait_until

SCOPE = bytes(range(16))
CHUNK = 64 << 10


def key(i: int) -> bytes:
    return i.to_bytes(2, "big") * 8


def payload(i: int, n: int = CHUNK) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


class Bufs:
    """Destination buffers for `FileTier.get`, and what was handed back."""

    def __init__(self) -> None:
        self.out: list[memoryview] = []
        self.back: list[memoryview] = []

    def alloc(self, n: int) -> memoryview:
        mv = memoryview(bytearray(n))
        self.out.append(mv)
        return mv

    def give_back(self, mv: memoryview) -> None:
        self.back.append(mv)


def read(t: FileTier, i: int, n: int | None = CHUNK) -> bytes | None:
    b = Bufs()
    got = t.get(SCOPE, key(i), n, b.alloc, b.give_back)
    return None if got is None else bytes(got)


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[FileTier]:
    t = FileTier(str(tmp_path), 1 << 30, timeout_s=2.0)
    t.start()
    yield t
    t.stop()
    t.join()


def files(root: Path) -> list[Path]:
    return sorted(root.glob(f"{FORMAT_DIR}/*/*/*/*.kv"))


def test_a_chunk_is_written_whole_where_the_layout_says_and_read_back_checked(
    tier: FileTier, tmp_path: Path
) -> None:
    done = threading.Event()
    assert tier.put(SCOPE, key(1), memoryview(payload(1)), done.set)
    assert tier.flush(10) and done.is_set()
    path = Path(chunk_path(str(tmp_path), SCOPE, key(1)))
    assert files(tmp_path) == [path]
    h = key(1).hex()
    assert path.parts[-4:] == (SCOPE.hex(), h[:2], h[2:4], h + ".kv")
    assert read(tier, 1) == payload(1)
    assert read(tier, 2) is None  # never written: a miss, no failure
    s = tier.stats()
    assert (s.hits, s.misses, s.puts, s.files) == (1, 1, 1, 1) and sum(s.get_failures.values()) == 0
    assert s.used_bytes == path.stat().st_size and not list(tmp_path.rglob("*.tmp"))
    assert read(tier, 1, n=CHUNK // 2) is None  # another layout's size: refused, counted, removed
    assert tier.stats().bad_files == {"layout": 1}
    wait_until(lambda: not path.exists(), 5, what="the file removed")


def test_two_tiers_writing_the_same_keys_at_once_publish_only_whole_files(tmp_path: Path) -> None:
    a, b = FileTier(str(tmp_path), 1 << 30), FileTier(str(tmp_path), 1 << 30)
    for t in (a, b):
        t.start()
    stop = threading.Event()
    seen: list[bytes | None] = []

    def reader() -> None:  # reads the files directly while they are being replaced
        while not stop.is_set():
            for i in range(8):
                try:
                    r = chunk_file.read_chunk(
                        chunk_path(str(tmp_path), SCOPE, key(i)),
                        key(i),
                        CHUNK,
                        lambda n: memoryview(bytearray(n)),
                    )
                except chunk_file.BadFile as exc:  # a torn file would land here
                    seen.append(str(exc).encode())
                    continue
                seen.append(None if r is None else bytes(r[0]))

    th = threading.Thread(target=reader)
    th.start()
    try:
        for _ in range(5):
            for t in (a, b):
                t.index = FileIndex()  # forget what is there: write it again, racing the other
            for i in range(8):
                for t in (a, b):
                    t.put(SCOPE, key(i), memoryview(payload(i)))
            assert a.flush(20) and b.flush(20)
    finally:
        stop.set()
        th.join()
        for t in (a, b):
            t.stop()
            t.join()
    whole = {payload(i) for i in range(8)}
    assert seen and all(s is None or s in whole for s in seen)
    assert len(files(tmp_path)) == 8 and not list(tmp_path.rglob("*.tmp"))


def test_lru_eviction_keeps_the_cap_and_a_hit_refreshes_a_chunk(tmp_path: Path) -> None:
    size = CHUNK + PAYLOAD_AT  # a file: its header, padded to a page, then the chunk
    t = FileTier(str(tmp_path), 3 * size)
    t.start()
    try:
        for i in range(3):
            t.put(SCOPE, key(i), memoryview(payload(i)))
            assert t.flush(10)
        assert read(t, 0) == payload(0)  # 0 is now the most recently used
        t.put(SCOPE, key(3), memoryview(payload(3)))
        assert t.flush(10)
        left = {p.name[:32] for p in files(tmp_path)}
        assert left == {key(i).hex() for i in (0, 2, 3)}  # 1 was the least recently used
        s = t.stats()
        assert s.evictions == 1 and s.used_bytes <= 3 * size and s.files == 3
        os.unlink(chunk_path(str(tmp_path), SCOPE, key(2)))  # another server removed it
        t.put(SCOPE, key(4), memoryview(payload(4)))
        assert t.flush(10)
        assert t.stats().evicted_gone == 1  # evicting a file already gone is no error
    finally:
        t.stop()
        t.join()


def written_oldest_first(root: Path, n: int) -> None:
    """Chunks 0 to ``n - 1`` written by a tier since stopped, chunk i last modified at 1000 + i."""
    a = FileTier(str(root), 1 << 30)
    a.start()
    for i in range(n):
        a.put(SCOPE, key(i), memoryview(payload(i)))
        assert a.flush(10)
        os.utime(chunk_path(str(root), SCOPE, key(i)), (1000.0 + i, 1000.0 + i))
    a.stop()
    a.join()


def test_a_restart_rebuilds_the_index_in_the_background_and_keeps_a_smaller_cap(tmp_path: Path) -> None:
    written_oldest_first(tmp_path, 6)
    size = files(tmp_path)[0].stat().st_size
    b = FileTier(str(tmp_path), 4 * size)
    b.start()
    try:
        assert read(b, 5) == payload(5)  # a hit whether or not the scan has ended
        wait_until(lambda: b.stats().rebuilt, 10, what="the rebuild")
        s = b.stats()
        assert s.files == 4 and s.used_bytes == 4 * size and s.evictions == 2
        assert {p.name[:32] for p in files(tmp_path)} == {key(i).hex() for i in (2, 3, 4, 5)}
    finally:
        b.stop()
        b.join()


def test_stale_temporary_files_are_swept_and_live_ones_kept(tmp_path: Path) -> None:
    leaf = Path(chunk_path(str(tmp_path), SCOPE, key(1))).parent
    leaf.mkdir(parents=True)
    name = key(1).hex() + ".kv"
    dead = leaf / f".{name}.{HOST}.{2**22 + 12345}.000000000001.tmp"  # no such pid
    mine = leaf / f".{name}.{HOST}.{os.getpid()}.000000000002.tmp"  # a writer still running
    other = leaf / f".{name}.otherhost.1.000000000003.tmp"  # another host's: young
    old = leaf / f".{name}.otherhost.2.000000000004.tmp"  # another host's: abandoned long ago
    for p in (dead, mine, other, old):
        p.write_bytes(b"partial")
    t0 = time.time() - STALE_TMP_S - 60
    os.utime(old, (t0, t0))
    t = FileTier(str(tmp_path), 1 << 30)
    t.start()
    try:
        wait_until(lambda: t.stats().rebuilt, 10, what="the scan")
        assert not dead.exists() and not old.exists() and mine.exists() and other.exists()
        assert t.stats().swept == 2 and t.stats().files == 0
    finally:
        t.stop()
        t.join()


def test_symlinks_fifos_and_foreign_files_are_refused_without_blocking(
    tier: FileTier, tmp_path: Path
) -> None:
    p1 = Path(chunk_path(str(tmp_path), SCOPE, key(1)))
    p1.parent.mkdir(parents=True)
    target = tmp_path / "elsewhere"
    target.write_bytes(encode(key(1), "uint8", (CHUNK,), payload(1)))
    p1.symlink_to(target)
    assert read(tier, 1) is None
    p2 = Path(chunk_path(str(tmp_path), SCOPE, key(2)))
    p2.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(p2)
    t0 = time.monotonic()
    assert read(tier, 2) is None and time.monotonic() - t0 < 1.5  # a FIFO never blocks a read
    s = tier.stats()
    assert s.bad_files == {"format": 2} and sum(s.get_failures.values()) == 0
    wait_until(lambda: not p1.is_symlink() and not p2.exists(), 5, what="both removed")
    assert target.exists()  # the link was removed, not what it pointed to


def test_a_disk_call_past_its_deadline_is_abandoned_and_cleaned_up_when_it_returns() -> None:
    pool = DiskPool(threads=1, timeout_s=0.2, max_pending=1)
    pool.start()
    release = threading.Event()
    late: list[str] = []
    try:
        t0 = time.monotonic()
        with pytest.raises(DiskTimeout):
            pool.call(lambda: release.wait(30) and "buffer", on_late=late.append)
        assert 0.15 < time.monotonic() - t0 < 2
        assert pool.stalled_for() > 0.1
        assert pool.submit(lambda: None)  # waits behind the stuck call: the queue's one place
        with pytest.raises(DiskBusy):  # the queue is full: refused at once
            pool.call(lambda: 1)
        release.set()
        wait_until(lambda: late == ["buffer"], 5, what="the late result cleaned up")
        assert pool.call(lambda: 7) == 7
        with pytest.raises(ZeroDivisionError):
            pool.call(lambda: 1 // 0)
    finally:
        release.set()
        pool.stop()
        assert pool.join(5)


def test_a_stuck_disk_makes_reads_miss_in_time_and_the_probe_time_out(tmp_path: Path) -> None:
    t = FileTier(str(tmp_path), 1 << 30, timeout_s=0.2, io_threads=2, health_timeout_s=0.3)
    t.start()
    release = threading.Event()
    try:
        t.put(SCOPE, key(1), memoryview(payload(1)))
        assert t.flush(10)
        for _ in range(2):  # every I/O thread stuck in a call that does not return
            assert t.io.submit(lambda: release.wait(30))
        t0 = time.monotonic()
        assert read(t, 1) is None
        assert time.monotonic() - t0 < 1.0
        assert t.stats().get_failures["timeout"] == 1 and t.take_failed_gets() == 1
        wait_until(lambda: t.stalled_for() > 0.3, 5, what="the stall")
        assert t.ping()[1] == TIMEOUT and not t.probe()
        release.set()
        wait_until(lambda: t.ping()[1] == OK, 5, what="the disk answering again")
        assert read(t, 1) == payload(1)
    finally:
        release.set()
        t.stop()
        t.join()


def test_writes_are_dropped_and_counted_when_the_queue_is_full_or_the_tier_bypassed(tmp_path: Path) -> None:
    t = FileTier(str(tmp_path), 1 << 30, queue_bytes=CHUNK)  # not started: nothing drains
    done: list[int] = []
    assert t.put(SCOPE, key(1), memoryview(payload(1)), lambda: done.append(1))
    assert not t.put(SCOPE, key(2), memoryview(payload(2)), lambda: done.append(2))
    t.bypassed = True
    assert not t.put(SCOPE, key(3), memoryview(payload(3)), lambda: done.append(3))
    drops = {"full": 1, "bypassed": 1, "stopped": 0, "no_space": 0, "cleared": 0}
    assert done == [2, 3] and t.stats().drops == drops
    t.stop()
    t.join()
    assert done == [2, 3, 1] and t.stats().drops["stopped"] == 1


def test_a_directory_that_does_not_exist_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        FileTier(str(tmp_path / "nope"), 1 << 30)
