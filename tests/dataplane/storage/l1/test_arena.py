"""The L1 arena: the shared segment reserved slice by slice by the fault-in thread (which steps
aside when asked), the private fallback, and L1 on top of it (a reserve waits for the arena's
growth instead of evicting, within a bound). Its allocator, first-fit extents with coalescing, is
tested in test_extents.py.

Every shared arena lives in a private directory on the shm tmpfs (as tests/dataplane/memory/test_shm.py
does); the cases about a directory without room mount a small tmpfs of their own (root only).
The fault-in thread is steered through ``yield_to`` (a `Gate`), so every intermediate state is
observed at a point where the thread is parked, never by timing.
"""

from __future__ import annotations

import gc
import logging
import os
import stat
from functools import partial
from pathlib import Path

import pytest
import torch

from dataplane.memory.shm import valid_segment_name
from dataplane.storage.l1 import L1Store
from dataplane.storage.l1 import arena as arena_mod
from dataplane.storage.l1 import store as l1_mod
from dataplane.storage.l1.arena import ALIGN, PAGE, Arena
from tests.dataplane.storage.l1.arena_helpers import (
    CAP,
    CHUNK,
    SLICE,
    Call,
    Gate,
    MiB,
    allocated,
    blocked_in,
    inside,
    key,
    present,
    put,
    use_dir,
)
from tests.helpers import mounted_tmpfs, wait_until


# ------------------------------------------------------------------------ Arena, shared
def test_shared_arena_is_a_private_segment_reserved_as_it_grows(shm_dir: Path, arenas: list[Arena]) -> None:
    a = Arena(CAP, shared=True)
    arenas.append(a)
    assert a.backing == "shm" and a.segment is not None
    path = shm_dir / a.segment.name
    assert valid_segment_name(a.segment.name) and f"-{os.getpid()}-" in a.segment.name
    assert [p.name for p in shm_dir.iterdir()] == [a.segment.name]  # no temporary name left
    st_ = os.lstat(path)
    assert stat.S_ISREG(st_.st_mode)
    assert st_.st_uid == os.geteuid()
    assert stat.S_IMODE(st_.st_mode) == 0o600
    assert st_.st_size == CAP
    # nothing reserved, nothing usable before start
    assert allocated(path) == 0
    assert a.growth() == (0, False)
    s = a.stats()
    assert (s.capacity_bytes, s.backing, s.faulted_bytes, s.ready) == (CAP, "shm", 0, False)
    assert a.wait_usable(0, 0.01) is False

    a.start()
    wait_until(lambda: a.growth() == (CAP, True), 10, what="the arena to grow")
    s = a.stats()
    assert s.ready and s.faulted_bytes == CAP
    assert s.huge_page_bytes == 0  # shmem gets no anonymous huge pages: not counted as the arena's
    assert allocated(path) == CAP
    assert a.wait_usable(CAP - 1, 0) is True
    assert a.join(5)

    a.close()
    assert not path.exists()
    assert list(shm_dir.iterdir()) == []
    a.close()  # idempotent


def test_segment_space_is_reserved_slice_by_slice_ahead_of_use(shm_dir: Path, arenas: list[Arena]) -> None:
    a = Arena(CAP, shared=True)
    arenas.append(a)
    assert a.segment is not None
    path = shm_dir / a.segment.name
    gate = Gate(upto=0)
    a.yield_to = gate
    a.start()
    for k in range(4):
        at = k * SLICE
        wait_until(partial(gate.parked_at, at), 10, what=f"the thread to park at slice {k}")
        # parked before reserving slice k: exactly k slices reserved, usable and faulted
        assert a.growth() == (k * SLICE, False)
        assert allocated(path) == k * SLICE
        assert a.stats().faulted_bytes == k * SLICE and not a.stats().ready
        assert a.wait_usable(k * SLICE, 0.01) is False  # no more yet
        if k:
            assert a.wait_usable(k * SLICE - 1, 0) is True
            a.view(k * SLICE - PAGE, PAGE).fill_(7)  # handed-out bytes are backed: no SIGBUS
        gate.upto = (k + 1) * SLICE
    wait_until(lambda: a.growth() == (CAP, True), 10, what="the arena to grow")
    assert allocated(path) == CAP and a.stats().ready
    assert gate.asked(CAP - SLICE) >= 1 and gate.asked(CAP) == 0  # asked before each slice only


def test_shared_arena_without_prefault_reserves_everything_at_once(
    shm_dir: Path, arenas: list[Arena]
) -> None:
    a = Arena(SLICE + 1, shared=True, prefault=False)
    arenas.append(a)
    assert a.capacity == SLICE + PAGE  # whole pages
    assert a.segment is not None
    assert allocated(shm_dir / a.segment.name) == a.capacity
    assert a.growth() == (a.capacity, True) and a.stats().ready
    a.start()  # no thread to start
    assert a.join(0)


def test_close_unlinks_even_while_the_thread_steps_aside(shm_dir: Path) -> None:
    a = Arena(CAP, shared=True)
    gate = Gate(upto=SLICE)
    a.yield_to = gate
    a.start()
    wait_until(lambda: gate.parked_at(SLICE), 10, what="the thread to park")
    a.close()  # stops and joins the thread first
    assert a.join(0)  # the thread has ended
    assert list(shm_dir.iterdir()) == []
    a.close()


# ----------------------------------------------------------------------- Arena, private
def test_private_arena_is_usable_at_once_and_faulted_in_by_the_thread(arenas: list[Arena]) -> None:
    a = Arena(CAP + 1, shared=False)
    arenas.append(a)
    assert a.capacity == CAP + PAGE
    assert (a.backing, a.segment) == ("private", None)
    assert a.growth() == (a.capacity, True)  # private memory needs no reservation
    assert a.stats().ready is False and a.stats().faulted_bytes == 0
    a.start()
    wait_until(lambda: a.stats().ready, 10, what="the private arena to be faulted in")
    assert a.stats().faulted_bytes == a.capacity
    a.view(a.capacity - 64, 64).fill_(1)
    assert int(a.region[-1]) == 1
    a.close()
    a.close()


def test_private_arena_without_prefault_is_ready_at_once(arenas: list[Arena]) -> None:
    a = Arena(PAGE, shared=False, prefault=False)
    arenas.append(a)
    assert a.stats().ready and a.growth() == (PAGE, True)
    a.start()  # nothing to fault in: no thread
    assert a.join(0) and a.stats().faulted_bytes == 0


def test_backing_is_private_where_the_directory_has_no_room(
    monkeypatch: pytest.MonkeyPatch, arenas: list[Arena]
) -> None:
    with mounted_tmpfs("72m") as d:
        use_dir(monkeypatch, d)
        st_ = os.statvfs(d)
        room = st_.f_bavail * st_.f_frsize
        fits = room - (64 << 20)  # the arena plus 64 MiB to spare: exactly the room there is
        assert fits > 0 and fits % PAGE == 0

        a = Arena(fits + PAGE)  # a page too big: private memory, nothing in the directory
        arenas.append(a)
        assert (a.backing, a.segment) == ("private", None)
        assert a.growth() == (a.capacity, True)
        assert list(d.iterdir()) == []
        a.start()
        wait_until(lambda: a.stats().ready, 10, what="the private arena to be faulted in")
        a.close()

        b = Arena(fits)  # fits exactly: a segment in the directory
        arenas.append(b)
        assert b.backing == "shm" and b.segment is not None
        assert [p.name for p in d.iterdir()] == [b.segment.name]
        assert b.growth() == (0, False)
        b.start()
        wait_until(lambda: b.growth() == (fits, True), 10, what="the shared arena to grow")
        assert allocated(d / b.segment.name) == fits
        b.close()
        assert list(d.iterdir()) == []


def test_backing_chosen_by_the_operator(monkeypatch: pytest.MonkeyPatch, arenas: list[Arena]) -> None:
    with mounted_tmpfs("72m") as d:
        use_dir(monkeypatch, d)
        room = os.statvfs(d).f_bavail * os.statvfs(d).f_frsize
        # shm asked for and no room: refused at once, naming the directory (never a sparse L1
        # that stops growing, or a copy that faults on a full tmpfs)
        with pytest.raises(OSError, match=f"l1_backing shm: {d} has {room} bytes free"):
            Arena(room + PAGE, shared=True)
        assert list(d.iterdir()) == []
        a = Arena(room - (64 << 20), shared=False)  # room enough, private asked for: private
        arenas.append(a)
        assert (a.backing, a.segment) == ("private", None) and list(d.iterdir()) == []
        b = Arena(room, shared=True)  # all the room there is (auto would keep 64 MiB spare)
        arenas.append(b)
        assert b.backing == "shm"
        a.close()
        b.close()


# -------------------------------------------------------------------- fault-in steps aside
def test_fault_in_makes_no_progress_while_told_to_step_aside(shm_dir: Path, arenas: list[Arena]) -> None:
    a = Arena(CAP, shared=True)
    arenas.append(a)
    assert a.segment is not None
    gate = Gate(upto=0)
    a.yield_to = gate
    a.start()
    wait_until(lambda: gate.asked(0) >= 25, 10, what="the thread to ask 25 times")
    assert a.growth() == (0, False)
    assert a.stats().faulted_bytes == 0
    assert allocated(shm_dir / a.segment.name) == 0
    assert gate.asked(0) >= 25 and gate.asked(SLICE) == 0  # it never went past the first slice
    gate.upto = CAP
    wait_until(lambda: a.growth() == (CAP, True), 10, what="the arena to grow")
    assert a.stats().ready


def test_stop_while_stepping_aside_ends_the_thread(
    shm_dir: Path, arenas: list[Arena], monkeypatch: pytest.MonkeyPatch
) -> None:
    a = Arena(CAP, shared=True)
    arenas.append(a)
    gate = Gate(upto=SLICE)
    a.yield_to = gate
    a.start()
    wait_until(lambda: gate.parked_at(SLICE), 10, what="the thread to park")
    a.stop()
    assert a.join(5)
    assert a.growth() == (SLICE, True)  # final: nothing more will come
    assert a.stats().ready is False
    waits: list[float | None] = []
    monkeypatch.setattr(a._grew, "wait", lambda timeout=None: waits.append(timeout) or False)
    assert a.wait_usable(SLICE, 5) is False
    assert waits == []  # no wait for growth that will not come


# ---------------------------------------------------------------------- L1 on the arena
def test_reserve_waits_for_the_arena_to_start(shm_dir: Path) -> None:
    a = Arena(CAP, shared=True)
    l1 = L1Store(CAP, arena=a)
    try:
        call = Call(lambda: l1.reserve(CHUNK))
        wait_until(lambda: blocked_in(call.thread, "wait_usable"), 5, what="the reserve to wait")
        assert l1.stats().rejected == 0
        a.start()
        buf = call.join(5)
        assert isinstance(buf, torch.Tensor) and buf.numel() == CHUNK
        assert inside(a, buf) and a.offset_of(buf) == 0
        s = l1.stats()
        assert (s.used_bytes, s.rejected, s.evictions) == (CHUNK, 0, 0)
        l1.abort(buf)
        call.result = None  # no reference to the buffer left
        del buf
    finally:
        l1.close()


def test_reserve_waits_for_growth_instead_of_evicting(shm_dir: Path) -> None:
    a = Arena(CAP, shared=True)
    l1 = L1Store(CAP, arena=a)
    gate = Gate(upto=SLICE)
    a.yield_to = gate  # in place of L1's own
    try:
        a.start()
        wait_until(lambda: gate.parked_at(SLICE), 10, what="the thread to park")
        for i in range(SLICE // CHUNK):
            put(l1, i)  # the usable slice is full of committed chunks
        call = Call(lambda: l1.reserve(CHUNK))
        wait_until(lambda: blocked_in(call.thread, "wait_usable"), 5, what="the reserve to wait")
        assert l1.stats().evictions == 0
        gate.upto = CAP
        buf = call.join(5)
        assert isinstance(buf, torch.Tensor)
        assert a.offset_of(buf) == SLICE  # from the new slice
        assert present(l1, 0, 1, 2, 3) == [True] * 4
        s = l1.stats()
        assert (s.evictions, s.rejected, s.used_bytes) == (0, 0, SLICE + CHUNK)
        l1.abort(buf)
        call.result = None  # no reference to the buffer left
        del buf
    finally:
        l1.close()


def test_the_arena_grows_ahead_of_what_l1_holds_not_to_its_capacity(shm_dir: Path) -> None:
    """A fresh server does not pay for pages no chunk needs yet: L1 keeps one slice ready
    beyond what it holds here, and the arena grows as chunks fill it, up to its capacity."""
    a = Arena(CAP, shared=True)
    assert a.segment is not None
    path = shm_dir / a.segment.name
    l1 = L1Store(CAP, arena=a, grow_ahead=SLICE)
    try:
        a.start()
        wait_until(lambda: a.stats().ready, 10, what="the arena ready ahead of use")
        assert a.growth() == (SLICE, False) and allocated(path) == SLICE  # one slice ahead, no more
        assert a.stats().faulted_bytes == SLICE
        for i in range(SLICE // CHUNK):
            put(l1, i)  # the ready slice fills: the next one is made ready behind the stores
        wait_until(lambda: a.growth()[0] == 2 * SLICE and a.stats().ready, 10, what="the next slice")
        assert a.growth() == (2 * SLICE, False) and allocated(path) == 2 * SLICE
        for i in range(SLICE // CHUNK, 3 * SLICE // CHUNK + 1):
            put(l1, i)  # past three slices: the last one is made ready too, and growth ends
        wait_until(lambda: a.growth() == (CAP, True), 10, what="the whole arena")
        assert allocated(path) == CAP and a.stats().ready and l1.stats().evictions == 0
    finally:
        l1.close()


def test_reserve_gives_up_after_the_bound_then_evicts_once_grown(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bound = 0.3
    monkeypatch.setattr(l1_mod, "_WAIT_FOR_ARENA_S", bound)
    a = Arena(CAP, shared=True)
    l1 = L1Store(CAP, arena=a)
    gate = Gate(upto=SLICE)  # growth stalls after one slice
    a.yield_to = gate
    try:
        a.start()
        wait_until(lambda: gate.parked_at(SLICE), 10, what="the thread to park")
        for i in range(SLICE // CHUNK):
            put(l1, i)
        waits: list[tuple[float, bool]] = []  # each wait for growth: (its bound, grew)
        wait_usable = a.wait_usable

        def spied(above: int, timeout_s: float) -> bool:
            grew = wait_usable(above, timeout_s)
            waits.append((timeout_s, grew))
            return grew

        monkeypatch.setattr(a, "wait_usable", spied)
        assert l1.reserve(CHUNK) is None
        assert waits == [(bound, False)]  # it waited the bound, once, no more
        s = l1.stats()
        assert (s.rejected, s.evictions, s.chunks) == (1, 0, 4)
        assert present(l1, 0, 1, 2, 3) == [True] * 4

        a.stop()  # growth ends short: now L1 evicts to make room
        assert a.join(5)
        assert a.growth() == (SLICE, True)
        buf = l1.reserve(CHUNK)
        assert buf is not None and a.offset_of(buf) == 0  # chunk 0's place
        assert present(l1, 0, 1, 2, 3) == [False, True, True, True]
        assert l1.stats().evictions == 1
        l1.abort(buf)
        del buf
    finally:
        l1.close()


def test_growth_stopped_by_a_full_directory(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="dataplane.storage.l1.arena")
    with mounted_tmpfs("16m") as d:
        use_dir(monkeypatch, d)
        # the directory had room at start and filled up since (other segments): 64 MiB asked of
        # a 16 MiB directory, past the start-up check
        monkeypatch.setattr(arena_mod, "_room_in", lambda _d: 1 << 40)
        a = Arena(CAP, shared=True)
        assert a.segment is not None
        path = d / a.segment.name
        l1 = L1Store(CAP, arena=a)
        gate = Gate(upto=SLICE)
        a.yield_to = gate
        try:
            a.start()
            wait_until(lambda: gate.parked_at(SLICE), 10, what="the thread to park")
            assert allocated(path) == SLICE
            for i in range(SLICE // CHUNK):
                put(l1, i)
            call = Call(lambda: l1.reserve(CHUNK))
            wait_until(lambda: blocked_in(call.thread, "wait_usable"), 5, what="the reserve to wait")
            gate.upto = CAP  # the next slice does not fit in the directory
            got = call.join(l1_mod._WAIT_FOR_ARENA_S / 2)  # woken when growth ends, not at the bound
            assert a.join(5)
            assert a.growth() == (SLICE, True)
            assert allocated(path) == SLICE  # the failed reservation left nothing behind
            assert not a.stats().ready
            errors = [r for r in caplog.records if r.levelno == logging.ERROR]
            assert len(errors) == 1, caplog.text
            msg = errors[0].getMessage()
            assert f"cannot reserve {SLICE} more bytes of L1 in {d}" in msg
            assert f"L1 stays at {SLICE} bytes" in msg
            # once the growth was final, the waiting reserve took another turn and evicted
            assert isinstance(got, torch.Tensor) and l1.stats().evictions == 1, l1.stats()
            assert l1.stats().rejected == 0
            assert a.offset_of(got) + CHUNK <= SLICE
            call.result = got = None
            before = l1.stats().evictions
            buf = l1.reserve(CHUNK)  # grown (short): L1 evicts what it holds
            assert buf is not None and a.offset_of(buf) + CHUNK <= SLICE
            assert l1.stats().evictions == before + 1
            assert l1.stats().used_bytes <= SLICE
            l1.abort(buf)
            del buf
        finally:
            l1.close()
            gc.collect()
        assert list(d.iterdir()) == []


def test_buffers_are_views_of_the_shared_arena(shm_dir: Path) -> None:
    a = Arena(CAP, shared=True)
    l1 = L1Store(CAP, arena=a)
    try:
        a.start()
        wait_until(lambda: a.growth() == (CAP, True), 10, what="the arena to grow")
        assert a.segment is not None
        fd = os.open(shm_dir / a.segment.name, os.O_RDONLY)
        try:
            sizes = [1000, 4096, 65, MiB + 3]
            for i, n in enumerate(sizes):
                buf = l1.reserve(n)
                assert buf is not None and buf.numel() == n and inside(a, buf)
                assert a.offset_of(buf) % ALIGN == 0
                buf.copy_((torch.arange(n) * (i + 3) % 251).to(torch.uint8))
                assert l1.commit(key(i), buf)
            got = l1.acquire_prefix([key(i) for i in range(len(sizes))])
            assert len(got) == len(sizes)
            for i, (n, buf) in enumerate(zip(sizes, got, strict=True)):
                want = (torch.arange(n) * (i + 3) % 251).to(torch.uint8)
                assert torch.equal(buf, want)
                off = a.offset_of(buf)
                assert torch.equal(a.region[off : off + n], want)  # the arena's own bytes
                assert os.pread(fd, n, off) == want.numpy().tobytes()  # and the segment's
            l1.release([key(i) for i in range(len(sizes))])
            del got, buf
        finally:
            os.close(fd)
    finally:
        l1.close()
    assert list(shm_dir.iterdir()) == []


def test_l1_reports_fragmentation_of_its_free_space() -> None:
    n = 4096
    l1 = L1Store(8 * n)  # a private arena of exactly 8 pages
    bufs = [l1.reserve(k * n) for k in (1, 2, 1, 3, 1)]
    assert all(b is not None for b in bufs)
    assert l1.stats().fragmentation == 0.0  # no free space at all
    a, b, c, d, e = bufs
    assert a is not None and b is not None and c is not None and d is not None and e is not None
    l1.abort(a)
    l1.abort(c)
    l1.abort(e)  # free: 1 page at 0, 1 at 3, 1 at 7
    assert l1.stats().fragmentation == pytest.approx(2 / 3)
    l1.abort(b)  # pages 0..3 are one piece, page 7 another
    assert l1.stats().fragmentation == pytest.approx(1 - 4 / 5)
    assert l1.commit(key(1), d)
    put(l1, 2, 4 * n)  # fills pages 0..3
    assert l1.stats().fragmentation == 0.0  # one free page left
    put(l1, 3, 2 * n)  # evicts chunk 1 (pages 4..6), lands on 4..5: pages 6 and 7 free together
    s = l1.stats()
    assert s.evictions == 1 and s.fragmentation == 0.0
    put(l1, 4, n)  # page 6
    put(l1, 5, 3 * n)  # evicts 2 (pages 0..3), lands on 0..2: pages 3 and 7 free apart
    s = l1.stats()
    assert s.evictions == 2 and s.fragmentation == pytest.approx(0.5)
    assert s.used_bytes == 6 * n
    l1.close()
