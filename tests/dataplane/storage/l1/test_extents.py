"""The L1 arena's allocator (`dataplane.storage.l1.arena.Extents`): first-fit extents with
coalescing, case by case and against a bitmap model."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane.storage.l1.arena import ALIGN, Extents

U = ALIGN  # one allocation unit of Extents


def test_sizes_round_up_to_64_bytes() -> None:
    e = Extents(16 * U)
    assert e.alloc(1) == 0
    assert e.alloc(1) == U  # the first took a whole unit
    assert e.free_bytes == 14 * U
    assert e.alloc(U + 1) == 2 * U  # two units
    assert e.alloc(U) == 4 * U  # exactly one unit stays one unit
    assert e.free_bytes == 11 * U
    e.free(U, 1)  # freeing rounds the same way: the whole unit comes back
    assert e.free_bytes == 12 * U
    assert e.alloc(U) == U
    assert Extents().alloc(1) is None  # no region, nothing to hand out


def test_first_fit_takes_the_lowest_extent_that_fits() -> None:
    e = Extents(10 * U)
    offs = [e.alloc(n * U) for n in (1, 1, 1, 2, 1, 3, 1)]
    assert offs == [0, U, 2 * U, 3 * U, 5 * U, 6 * U, 9 * U]
    for off, n in ((U, U), (3 * U, 2 * U), (6 * U, 3 * U)):
        e.free(off, n)  # free extents: 1 unit at U, 2 at 3U, 3 at 6U (none adjacent)
    assert (e.free_bytes, e.largest()) == (6 * U, 3 * U)
    assert e.alloc(2 * U) == 3 * U  # skips the 1-unit extent, not the best fit but the first
    assert e.alloc(U) == U
    assert e.alloc(2 * U) == 6 * U  # the 3-unit extent, split: one unit stays at 8U
    assert e.alloc(2 * U) is None
    assert e.alloc(U) == 8 * U
    assert e.free_bytes == 0 and e.largest() == 0


def test_first_fit_is_not_best_fit() -> None:
    e = Extents(8 * U)
    assert [e.alloc(n * U) for n in (1, 2, 2, 1, 2)] == [0, U, 3 * U, 5 * U, 6 * U]
    e.free(U, 2 * U)  # two units at U
    e.free(5 * U, U)  # one unit at 5U: a best fit for one unit
    assert e.alloc(1) == U  # first fit splits the lower, bigger extent
    assert e.alloc(1) == 2 * U
    assert e.alloc(1) == 5 * U


def full(units: int) -> Extents:
    e = Extents(units * U)
    assert [e.alloc(U) for _ in range(units)] == [i * U for i in range(units)]
    assert e.free_bytes == 0
    return e


def test_free_coalesces_with_the_next_extent() -> None:
    e = full(4)
    e.free(2 * U, U)
    e.free(U, U)  # [U, 2U) joins [2U, 3U) after it
    assert (e.free_bytes, e.largest(), e.fragmentation()) == (2 * U, 2 * U, 0.0)
    assert e.alloc(2 * U) == U  # one extent


def test_free_coalesces_with_the_previous_extent() -> None:
    e = full(4)
    e.free(U, U)
    e.free(2 * U, U)  # [2U, 3U) joins [U, 2U) before it
    assert (e.free_bytes, e.largest(), e.fragmentation()) == (2 * U, 2 * U, 0.0)
    assert e.alloc(2 * U) == U


def test_free_coalesces_with_both_neighbours_at_once() -> None:
    e = full(5)
    e.free(U, U)
    e.free(3 * U, U)
    assert (e.free_bytes, e.largest(), e.fragmentation()) == (2 * U, U, 0.5)
    e.free(2 * U, U)  # bridges the two: one extent [U, 4U)
    assert (e.free_bytes, e.largest(), e.fragmentation()) == (3 * U, 3 * U, 0.0)
    e.free(0, U)
    e.free(4 * U, U)  # the ends join it too: the whole region again
    assert (e.free_bytes, e.largest(), e.fragmentation()) == (5 * U, 5 * U, 0.0)
    assert e.alloc(5 * U) == 0


def test_accounting_after_a_scripted_sequence() -> None:
    e = Extents(1024)
    assert (e.free_bytes, e.largest(), e.fragmentation()) == (1024, 1024, 0.0)
    assert [e.alloc(n) for n in (100, 200, 64, 300)] == [0, 128, 384, 448]  # 128+256+64+320 bytes
    assert (e.free_bytes, e.largest(), e.fragmentation()) == (256, 256, 0.0)
    e.free(128, 200)  # extents: 256 at 128, 256 at 768
    assert (e.free_bytes, e.largest(), e.fragmentation()) == (512, 256, 0.5)
    e.free(448, 300)  # joins the one at 768: 576 at 448
    assert (e.free_bytes, e.largest()) == (832, 576)
    assert e.fragmentation() == pytest.approx(1 - 576 / 832)
    assert e.alloc(500) == 448  # 512 bytes: too big for the extent at 128
    assert (e.free_bytes, e.largest()) == (320, 256)  # 256 at 128, 64 at 960
    assert e.fragmentation() == pytest.approx(0.2)
    assert e.alloc(257) is None
    e.free(0, 100)
    e.free(384, 64)  # 0..448 is one extent now
    assert (e.free_bytes, e.largest()) == (512, 448)
    assert e.fragmentation() == pytest.approx(1 - 448 / 512)
    e.free(448, 500)
    assert (e.free_bytes, e.largest(), e.fragmentation()) == (1024, 1024, 0.0)


def free_runs(bitmap: bytearray) -> list[tuple[int, int]]:
    """Maximal runs of free units, as (first unit, length), lowest first."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, used in enumerate([*bitmap, 1]):
        if not used and start is None:
            start = i
        elif used and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


@settings(max_examples=300, deadline=None)
@given(
    units=st.integers(1, 48),
    ops=st.lists(st.tuples(st.booleans(), st.integers(1, 50 * U), st.integers(0, 1 << 16)), max_size=60),
    rnd=st.randoms(use_true_random=False),
)
def test_extents_against_a_bitmap_model(
    units: int, ops: list[tuple[bool, int, int]], rnd: random.Random
) -> None:
    size = units * U
    e = Extents(size)
    bitmap = bytearray(units)  # one byte per 64-byte unit: 1 while a live allocation holds it
    live: list[tuple[int, int]] = []  # (offset, bytes asked for)
    for do_alloc, n, pick in ops:
        if do_alloc or not live:
            need = -(-n // U)
            fits = [start for start, length in free_runs(bitmap) if length >= need]
            off = e.alloc(n)
            assert off == (fits[0] * U if fits else None), (n, bitmap)  # first fit, exactly
            if off is None:
                continue
            assert off % U == 0 and off >= 0 and off + need * U <= size  # inside the region
            assert not any(bitmap[off // U : off // U + need])  # overlaps no live allocation
            bitmap[off // U : off // U + need] = b"\x01" * need
            live.append((off, n))
        else:
            off, n = live.pop(pick % len(live))
            e.free(off, n)
            need = -(-n // U)
            bitmap[off // U : off // U + need] = bytes(need)
        runs = free_runs(bitmap)
        assert e.free_bytes == bitmap.count(0) * U
        largest = max((length for _, length in runs), default=0) * U
        assert e.largest() == largest
        assert e.fragmentation() == (1 - largest / e.free_bytes if e.free_bytes else 0.0)
    rnd.shuffle(live)
    for off, n in live:
        e.free(off, n)
    assert (e.free_bytes, e.largest(), e.fragmentation()) == (size, size, 0.0)  # one extent
    assert e.alloc(size) == 0
