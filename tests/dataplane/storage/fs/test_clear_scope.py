"""`FileTier.clear_scope` on a real directory: a scope's chunk files removed and forgotten,
another scope's kept, its queued writes dropped (none lands after the clear), the write in
progress waited for, and one KV event per file removed."""

from __future__ import annotations

import errno
import functools
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dataplane.events.sink import EventSink
from dataplane.events.vllm_format import MEDIUM_DISK
from dataplane.storage.fs import FileTier, chunk_file, layout
from dataplane.storage.fs import tier as tier_module
from dataplane.storage.fs.layout import FORMAT_DIR, ScannedFile, chunk_path, scope_dir
from dataplane.storage.keys import ScopeMatch
from tests.helpers import wait_until

A = bytes(range(16))
B = bytes(range(16, 32))
CHUNK = 64 << 10
WRITER = "kvwarden-fs-writer"  # the writer thread's name


def key(i: int) -> bytes:
    return i.to_bytes(2, "big") * 8


def payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()


def read(t: FileTier, scope: bytes, i: int) -> bytes | None:
    got = t.get(scope, key(i), CHUNK, lambda n: memoryview(bytearray(n)), lambda mv: None)
    return None if got is None else bytes(got)


def files(root: Path, scope: bytes) -> list[Path]:
    return sorted(root.glob(f"{FORMAT_DIR}/{scope.hex()}/*/*/*.kv"))


class WatchedLock:
    """A lock that tells which threads are waiting for it (or holding it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.entered: set[str] = set()

    def __enter__(self) -> None:
        self.entered.add(threading.current_thread().name)
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        self.entered.discard(threading.current_thread().name)


@pytest.fixture
def gate() -> WatchedLock:
    return WatchedLock()


@pytest.fixture
def tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gate: WatchedLock) -> Iterator[FileTier]:
    t = FileTier(str(tmp_path), 1 << 30, timeout_s=2.0)
    t.events = EventSink()
    monkeypatch.setattr(t, "_write_gate", gate)  # (before start: no thread holds the old one)
    t.start()
    yield t
    t.stop()
    t.join()


def clearing(t: FileTier, scope: bytes, gate: WatchedLock) -> tuple[threading.Thread, list[int | None]]:
    """``clear_scope(scope)`` on a thread of its own, once it waits for the gate."""
    out: list[int | None] = []
    th = threading.Thread(target=lambda: out.append(t.clear_scope(ScopeMatch(scope))), name="clearing")
    th.start()
    wait_until(lambda: "clearing" in gate.entered, 10, what="the clear waiting for the gate")
    return th, out


def written(t: FileTier, scope: bytes, ids: range) -> None:
    for i in ids:
        assert t.put(scope, key(i), memoryview(payload(i)))
    assert t.flush(10)


def test_a_scope_cleared_loses_its_files_only_and_the_index_drops_exactly_their_bytes(
    tier: FileTier, tmp_path: Path
) -> None:
    written(tier, A, range(0, 5))
    written(tier, B, range(100, 103))
    a_bytes = sum(p.stat().st_size for p in files(tmp_path, A))
    n, used = tier.index.sizes()
    assert n == 8 and len(files(tmp_path, A)) == 5 and len(files(tmp_path, B)) == 3
    tier.events.take(100)  # (the writes' reports)

    assert tier.clear_scope(ScopeMatch(A)) == 5
    assert files(tmp_path, A) == [] and len(files(tmp_path, B)) == 3
    assert tier.index.sizes() == (n - 5, used - a_bytes)
    assert tier.held(A, [key(i) for i in range(5)]) == 0 and read(tier, A, 0) is None
    assert tier.held(B, [key(i) for i in range(100, 103)]) == 3
    assert all(read(tier, B, i) == payload(i) for i in range(100, 103))
    reports = tier.events.take(100)
    assert sorted(reports) == sorted(("removed", key(i), MEDIUM_DISK) for i in range(5))
    assert tier.clear_scope(ScopeMatch(A)) == 0 and tier.events.take(100) == []  # nothing left to remove


def test_queued_writes_of_the_scope_never_land_and_the_others_do(tier: FileTier, tmp_path: Path) -> None:
    written(tier, A, range(0, 2))
    entered, release = threading.Event(), threading.Event()

    def blocked() -> None:  # the writer thread, done with a write: held here, the queue waits
        entered.set()
        release.wait(30)

    assert tier.put(B, key(100), memoryview(payload(100)), blocked)
    assert entered.wait(10)
    done: list[int] = []
    for scope, i in [(A, 2), (B, 101), (A, 3), (B, 102), (A, 4)]:
        assert tier.put(scope, key(i), memoryview(payload(i)), functools.partial(done.append, i))
    assert tier.stats().queue_depth == 5

    assert tier.clear_scope(ScopeMatch(A)) == 2
    assert done == [2, 3, 4]  # dropped, their done called
    s = tier.stats()
    assert (s.queue_depth, s.queue_bytes, s.drops["cleared"]) == (2, 2 * CHUNK, 3)
    release.set()
    assert tier.flush(10) and done == [2, 3, 4, 101, 102]  # B's, in their order
    assert files(tmp_path, A) == [] and len(files(tmp_path, B)) == 3
    assert all(read(tier, A, i) is None for i in range(5))
    assert all(read(tier, B, i) == payload(i) for i in range(100, 103))
    s = tier.stats()
    assert (s.queue_depth, s.queue_bytes, s.files) == (0, 0, 3)


def test_a_write_of_the_scope_in_progress_is_waited_for_then_removed(
    tier: FileTier, gate: WatchedLock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered, release = threading.Event(), threading.Event()
    real = chunk_file.write_chunk

    def slow(path: str, root: str, parts: Sequence[bytes | memoryview]) -> int:
        entered.set()  # the writer thread, inside a write of A: held here
        release.wait(30)
        return real(path, root, parts)

    monkeypatch.setattr(chunk_file, "write_chunk", slow)
    assert tier.put(A, key(1), memoryview(payload(1)))
    assert entered.wait(10) and WRITER in gate.entered
    dropped = threading.Event()
    assert tier.put(A, key(2), memoryview(payload(2)), dropped.set)  # queued behind it
    th, cleared = clearing(tier, A, gate)
    assert dropped.is_set() and not cleared  # the queue purged; the write in progress waited for
    release.set()
    th.join(10)
    assert cleared == [1] and files(tmp_path, A) == [] and key(1) not in tier.index
    assert tier.flush(10) and files(tmp_path, A) == [] and tier.stats().drops["cleared"] == 1


def test_a_rescan_under_way_is_waited_for_and_never_relearns_a_file_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gate: WatchedLock
) -> None:
    first = FileTier(str(tmp_path), 1 << 30)
    first.start()
    written(first, A, range(0, 3))
    first.stop()
    first.join()
    listed, release = threading.Event(), threading.Event()

    def slow_scan(*args: Any) -> Iterator[ScannedFile]:  # the directory listed, then held
        found = list(layout.scan(*args))
        listed.set()
        release.wait(30)
        yield from found

    monkeypatch.setattr(tier_module, "scan", slow_scan)
    t = FileTier(str(tmp_path), 1 << 30)
    monkeypatch.setattr(t, "_write_gate", gate)
    t.start()
    try:
        assert listed.wait(10) and WRITER in gate.entered
        th, cleared = clearing(t, A, gate)
        assert not cleared
        release.set()
        th.join(10)
        assert cleared == [3] and files(tmp_path, A) == []
        assert t.flush(10) and t.index.sizes() == (0, 0)
    finally:
        release.set()
        t.stop()
        t.join()


def test_what_the_walk_leaves_temporary_files_and_index_entries_of_files_gone(
    tier: FileTier, tmp_path: Path
) -> None:
    written(tier, A, range(0, 3))
    os.unlink(chunk_path(str(tmp_path), A, key(0)))  # another server removed it
    live = Path(chunk_path(str(tmp_path), A, key(9)))
    tmp = live.with_name(f".{live.name}.otherhost.1.abcdef012345.tmp")  # another's write under way
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_bytes(b"x")
    tier.events.take(100)
    assert tier.clear_scope(ScopeMatch(A)) == 2  # the file already gone is not counted
    assert tmp.exists() and files(tmp_path, A) == []
    assert tier.index.sizes() == (0, 0)  # forgotten too
    assert len(tier.events.take(100)) == 2


def test_no_directory_is_zero_a_bypassed_tier_none_an_empty_scope_an_error(
    tier: FileTier, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert not os.path.exists(scope_dir(str(tmp_path), A))
    assert tier.clear_scope(ScopeMatch(A)) == 0
    with pytest.raises(ValueError):
        tier.clear_scope(ScopeMatch(b""))
    written(tier, A, range(0, 2))
    tier.bypassed = True
    assert tier.clear_scope(ScopeMatch(A)) is None
    assert len(files(tmp_path, A)) == 2
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "not cleared" in r.message]
    assert len(warnings) == 1 and "bypassed" in warnings[0].message


def test_a_disk_call_that_fails_is_none_with_one_warning_naming_it(
    tier: FileTier, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    written(tier, A, range(0, 2))

    def failing(path: str) -> bool:
        raise OSError(errno.EIO, "Input/output error", path)

    monkeypatch.setattr(chunk_file, "remove", failing)
    assert tier.clear_scope(ScopeMatch(A)) is None
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "not cleared" in r.message]
    assert len(warnings) == 1 and "EIO" in warnings[0].message
    assert len(files(tmp_path, A)) == 2 and tier.index.sizes()[0] == 2  # what is there stays known
