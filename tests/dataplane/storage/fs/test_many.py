"""Several warm chunk files read in place side by side (`FileReads.get_many_into`, through
`TieredStore.acquire_into` given a chunk's bytes): the same bytes and counts as one by one, the
run cut at the first chunk that is cold, missing or damaged, and nothing written into the
caller's views once the request has answered, even by an open that returns late on a mount
that stopped answering."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dataplane.storage.fs import FileTier, chunk_file
from dataplane.storage.fs.layout import chunk_path
from dataplane.storage.fs.resident import CopyGate
from dataplane.storage.tiered import TieredStore
from tests.dataplane.storage.test_tiered_fs import COLD, SCOPE, damage, key, store
from tests.fuse_mount import FuseMount
from tests.helpers import wait_until
from tests.page_cache import drop_from_page_cache

CHUNK = COLD  # (the tests drop files from the page cache)
L1 = 4 << 20  # an L1's bytes: room for the few chunks of a test


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[FileTier]:
    t = FileTier(str(tmp_path), 1 << 30, timeout_s=2.0, io_threads=4)
    t.start()
    yield t
    t.stop()
    t.join()


def stored(fs: FileTier, root: Path, ids: range) -> tuple[list[bytes], list[torch.Tensor]]:
    """Chunks ``ids`` written to the tier, their files warm; their keys and bytes."""
    t = TieredStore(L1, fs=fs)
    want = [store(t, i, CHUNK) for i in ids]
    assert fs.flush(10)
    keys = [key(i) for i in ids]
    for k in keys:
        Path(chunk_path(str(root), SCOPE, k)).read_bytes()
    return keys, want


class Dest:
    """The caller's views: chunk i in ``bufs[i]``, in two pieces."""

    def __init__(self, n: int) -> None:
        self.bufs = [torch.zeros(CHUNK, dtype=torch.uint8) for _ in range(n)]

    def into(self, i: int, n: int) -> list[memoryview] | None:
        if n != CHUNK:
            return None
        half = n // 2
        return [self.bufs[i][:half].numpy().data.cast("B"), self.bufs[i][half:].numpy().data.cast("B")]


def test_warm_chunks_are_read_in_place_side_by_side_counted_once_then_promoted(
    fs: FileTier, tmp_path: Path
) -> None:
    keys, want = stored(fs, tmp_path, range(30, 36))
    cold, dest = TieredStore(L1, fs=fs), Dest(len(keys))
    got = cold.acquire_into(keys, dest.into, scope=SCOPE, nbytes=CHUNK)
    assert got == [None] * len(keys)
    assert all(torch.equal(d, w) for d, w in zip(dest.bufs, want, strict=True))
    s = fs.stats()
    assert (s.hits, s.misses, s.read_in_place) == (len(keys), 0, len(keys))
    wait_until(lambda: fs.stats().promoted == len(keys), 5, what="the chunks read in place to reach L1")
    assert cold.prefix_hits(keys, SCOPE) == len(keys) and cold.stats().chunks == len(keys)


@pytest.mark.parametrize("what", ["cold", "missing", "damaged"])
def test_the_run_ends_at_a_cold_missing_or_damaged_chunk_counted_once(
    fs: FileTier, tmp_path: Path, what: str
) -> None:
    keys, want = stored(fs, tmp_path, range(40, 45))
    path = chunk_path(str(tmp_path), SCOPE, keys[2])
    if what == "cold":
        drop_from_page_cache(path)
    elif what == "missing":
        os.unlink(path)
    else:
        damage(path)
    cold, dest = TieredStore(L1, fs=fs), Dest(len(keys))
    got = cold.acquire_into(keys, dest.into, scope=SCOPE, nbytes=CHUNK)
    s = fs.stats()
    assert got[:2] == [None, None] and all(torch.equal(dest.bufs[i], want[i]) for i in (0, 1))
    if what == "cold":  # that chunk and those after it read through L1, in order
        assert len(got) == 5 and all(torch.equal(g, w) for g, w in zip(got[2:], want[2:], strict=True))
        assert (s.hits, s.misses, s.read_in_place) == (5, 0, 2)
        cold.release([k for k, g in zip(keys, got, strict=True) if g is not None])
    else:  # the prefix ends there
        assert len(got) == 2 and (s.hits, s.misses, s.read_in_place) == (2, 1, 2)
        assert sum(s.bad_files.values()) == (what == "damaged") and s.bad_files.get("checksum", 0) == (
            what == "damaged"
        )


def test_without_a_chunk_size_or_with_one_chunk_they_go_one_by_one(fs: FileTier, tmp_path: Path) -> None:
    keys, want = stored(fs, tmp_path, range(50, 53))
    dest = Dest(len(keys))
    asked: list[int] = []

    def into(i: int, n: int) -> list[memoryview] | None:
        asked.append(i)
        return dest.into(i, n)

    assert TieredStore(L1, fs=fs).acquire_into(keys, into, scope=SCOPE) == [None] * 3
    assert asked == [0, 1, 2] and all(torch.equal(d, w) for d, w in zip(dest.bufs, want, strict=True))
    assert fs.get_many_into(SCOPE, keys[:1], CHUNK, lambda i: dest.into(i, CHUNK)) == []
    assert fs.get_many_into(SCOPE, keys, CHUNK, lambda i: None) == []


def test_a_late_open_on_a_mount_that_stopped_answering_writes_nothing(tmp_path: Path) -> None:
    mount = FuseMount(tmp_path / "backing", tmp_path / "mnt")
    fs = FileTier(str(tmp_path / "mnt"), 1 << 30, timeout_s=0.3, io_threads=4)
    fs.start()
    try:
        keys, _ = stored(fs, tmp_path / "mnt", range(60, 63))
        dest = Dest(len(keys))
        mount.freeze()  # every open now blocks in the kernel (a mount like this one reads
        # nothing in place anyway: the test above holds opens on a disk that does)
        got = TieredStore(L1, fs=fs).acquire_into(keys, dest.into, scope=SCOPE, nbytes=CHUNK)
        failures = fs.stats().get_failures
        assert got == [] and failures["timeout"] == 1 and sum(failures.values()) == 1
        mount.thaw()  # the opens return now, after the request answered
        wait_until(lambda: fs.io.stalled_for() == 0 and fs.io.pending() == 0, 10, what="the opens to end")
        assert not any(d.any() for d in dest.bufs)  # none of them copied
    finally:
        mount.thaw()
        fs.stop()
        fs.join()
        mount.close()


def test_opens_that_return_after_the_deadline_copy_nothing(
    fs: FileTier, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The opens of all but the first chunk held past the deadline (the disk call itself, at
    its seam): the first lands, the RETRIEVE ends there, and the late ones, let go after it
    answered, never touch the views (the files are warm: nothing else would stop them)."""
    fs.io.timeout_s = 0.3
    keys, want = stored(fs, tmp_path, range(70, 73))
    late = threading.Event()
    real = chunk_file.open_chunk

    def open_chunk(path: str, key: bytes, nbytes: int | None) -> chunk_file.Opened | None:
        if key != keys[0]:
            late.wait(10)
        return real(path, key, nbytes)

    monkeypatch.setattr(chunk_file, "open_chunk", open_chunk)
    dest = Dest(len(keys))
    got = TieredStore(L1, fs=fs).acquire_into(keys, dest.into, scope=SCOPE, nbytes=CHUNK)
    assert got == [None] and torch.equal(dest.bufs[0], want[0])
    late.set()
    wait_until(lambda: fs.io.stalled_for() == 0 and fs.io.pending() == 0, 10, what="the late opens to end")
    assert not dest.bufs[1].any() and not dest.bufs[2].any()
    assert fs.stats().read_in_place == 1


def test_the_gate_lets_copies_start_only_while_open_and_shuts_after_those_under_way() -> None:
    gate = CopyGate()
    assert gate.enter()
    shut = threading.Thread(target=gate.shut)
    shut.start()
    shut.join(0.2)
    assert shut.is_alive()  # a copy is under way: shut waits for it
    gate.leave()
    shut.join(5)
    assert not shut.is_alive()
    assert not gate.enter()  # shut: no copy starts any more
