"""Chunk files read in place (`resident`): from the page cache straight into scattered views,
checked whole; a file not all in memory is refused (the staged read takes it), a damaged or
cut one is never reported read. Real files on the disk under pytest's temporary directory."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from dataplane.storage.fs import chunk_file, resident
from dataplane.storage.fs.chunk_file import BadFile, Opened
from dataplane.storage.fs.disk import DiskPool
from tests.page_cache import drop_from_page_cache

KEY = b"k" * 16
N = 3 * resident.PIECE + 12_345  # pieces, and a tail


def write(path: Path, payload: bytes, key: bytes = KEY) -> None:
    head = chunk_file.file_header(key, memoryview(payload))
    chunk_file.write_chunk(str(path), str(path.parent), (head, payload))


@pytest.fixture
def payload() -> bytes:
    return np.random.default_rng(3).integers(0, 256, N, dtype=np.uint8).tobytes()


@pytest.fixture
def opened(tmp_path: Path, payload: bytes) -> Iterator[tuple[Path, Opened]]:
    path = tmp_path / "chunk"
    write(path, payload)
    path.read_bytes()  # in the page cache
    f = chunk_file.open_chunk(str(path), KEY, N)
    assert f is not None
    yield path, f
    os.close(f.fd)


def scattered(n: int, pieces: int) -> tuple[bytearray, list[memoryview]]:
    """A buffer twice ``n`` long and ``pieces`` views of it that add up to ``n`` bytes, apart
    (the even pieces in its first half, the odd ones in its second)."""
    mem = bytearray(2 * n)
    cut = np.linspace(0, n, pieces + 1).astype(int)
    views = []
    for j in range(pieces):
        at = n + cut[j] if j % 2 else cut[j]
        views.append(memoryview(mem)[at : at + cut[j + 1] - cut[j]])
    return mem, views


def test_a_file_in_the_page_cache_lands_in_scattered_views_checked(
    opened: tuple[Path, Opened], payload: bytes
) -> None:
    _, f = opened
    _, views = scattered(N, 37)
    assert resident.read_resident(f, views)
    assert b"".join(bytes(v) for v in views) == payload


def test_a_file_out_of_the_page_cache_is_refused_not_waited_for(
    opened: tuple[Path, Opened], payload: bytes
) -> None:
    path, f = opened
    drop_from_page_cache(path)
    _, views = scattered(N, 5)
    assert not resident.read_resident(f, views)  # (the staged read, under its deadline, takes it)
    path.read_bytes()
    assert resident.read_resident(f, views) and b"".join(bytes(v) for v in views) == payload


def flipped(path: Path, payload: bytes) -> None:
    """``payload`` written to ``path`` with one bit of its last piece flipped."""
    write(path, payload)
    with open(path, "r+b") as fh:
        fh.seek(-7, os.SEEK_END)
        b = fh.read(1)
        fh.seek(-7, os.SEEK_END)
        fh.write(bytes([b[0] ^ 1]))


def damaged(path: Path, payload: bytes) -> Opened:
    """`flipped`, opened (its header checks)."""
    flipped(path, payload)
    f = chunk_file.open_chunk(str(path), KEY, N)
    assert f is not None
    return f


def test_a_damaged_byte_anywhere_is_a_bad_file(tmp_path: Path, payload: bytes) -> None:
    f = damaged(tmp_path / "chunk", payload)
    try:
        with pytest.raises(BadFile) as exc:
            resident.read_resident(f, scattered(N, 3)[1])
        assert exc.value.kind == "checksum" and exc.value.ino == os.stat(tmp_path / "chunk").st_ino
    finally:
        os.close(f.fd)


def test_a_file_cut_after_its_header_was_read_is_a_bad_file(opened: tuple[Path, Opened]) -> None:
    path, f = opened
    os.truncate(path, f.header.start + resident.PIECE)  # (another writer's damage, mid-read)
    with pytest.raises(BadFile) as exc:
        resident.read_resident(f, scattered(N, 4)[1])
    assert exc.value.kind == "truncated"


def test_views_that_do_not_add_up_to_the_payload_are_an_error(opened: tuple[Path, Opened]) -> None:
    _, f = opened
    with pytest.raises(ValueError, match=f"destination of {N - 1} bytes for a payload of {N}"):
        resident.read_resident(f, scattered(N - 1, 3)[1])


def test_pieces_cut_long_views_and_keep_the_order() -> None:
    mem = bytearray(5 * resident.PIECE // 2)
    views = [memoryview(mem)[: resident.PIECE // 4], memoryview(mem)[resident.PIECE // 4 :]]
    groups = resident._pieces(views)
    sizes = [sum(v.nbytes for v in g) for g in groups]
    assert sizes[:-1] == [resident.PIECE + resident.PIECE // 4, resident.PIECE] and sum(sizes) == len(mem)
    flat = [v for g in groups for v in g]
    assert b"".join(bytes(v) for v in flat) == bytes(mem)


def test_a_staged_read_is_followed_piece_by_piece_into_scattered_views(tmp_path: Path) -> None:
    n = 2 * resident.STAGE_PIECE + 12_345  # three pieces
    data = np.random.default_rng(5).integers(0, 256, n, dtype=np.uint8).tobytes()
    path = tmp_path / "chunk"
    write(path, data)
    staging = bytearray(n)
    landing = resident.Landing()
    out: list[object] = []

    def read() -> None:
        try:
            out.append(chunk_file.read_chunk(str(path), KEY, n, lambda size: memoryview(staging), landing))
        finally:
            landing.end()

    reader = threading.Thread(target=read)
    reader.start()
    _, views = scattered(n, 41)  # (views that straddle the pieces)
    assert resident.follow(landing, views, time.monotonic() + 30)
    reader.join(30)
    assert b"".join(bytes(v) for v in views) == data and bytes(staging) == data and out[0] is not None


def test_a_damaged_file_followed_lands_whole_and_the_read_says_it_failed_its_check(tmp_path: Path) -> None:
    n = 2 * resident.STAGE_PIECE + 12_345
    data = np.random.default_rng(6).integers(0, 256, n, dtype=np.uint8).tobytes()
    path = tmp_path / "chunk"
    flipped(path, data)
    staging = bytearray(n)
    landing = resident.Landing()
    raised: list[BaseException] = []

    def read() -> None:
        try:
            chunk_file.read_chunk(str(path), KEY, n, lambda size: memoryview(staging), landing)
        except BaseException as exc:
            raised.append(exc)
        finally:
            landing.end()

    reader = threading.Thread(target=read)
    reader.start()
    _, views = scattered(n, 41)
    assert resident.follow(landing, views, time.monotonic() + 30)  # (it copies; the read checks)
    reader.join(30)
    assert len(raised) == 1 and isinstance(raised[0], BadFile) and raised[0].kind == "checksum"


def test_a_follower_past_its_deadline_stops_and_the_reader_stops_after_it(tmp_path: Path) -> None:
    landing = resident.Landing()
    assert not resident.follow(landing, None, time.monotonic() + 0.05)  # nothing ever landed
    landing.abandon()
    assert not landing.add(1)  # the reader is told at its next piece


# ------------------------------------------------------- a payload read in parts (`Parts`)


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resident, "MIN_PART", resident.PIECE)  # (N: three parts of a piece or more)


def at_once(fn: Callable[[], object]) -> bool:
    """A helper that copies its part the moment it is handed it (before this thread starts)."""
    fn()
    return True


def test_parts_copied_by_helpers_are_hashed_behind_them_in_order(
    opened: tuple[Path, Opened], payload: bytes, small_parts: None
) -> None:
    _, f = opened
    _, views = scattered(N, 37)
    assert resident.read_resident(f, views, 3, at_once)  # (every part but the first: a helper's)
    assert b"".join(bytes(v) for v in views) == payload


def test_a_damaged_byte_in_a_helpers_part_is_a_bad_file(
    tmp_path: Path, payload: bytes, small_parts: None
) -> None:
    f = damaged(tmp_path / "chunk", payload)
    try:
        with pytest.raises(BadFile) as exc:
            resident.read_resident(f, scattered(N, 3)[1], 3, at_once)
        assert exc.value.kind == "checksum"
    finally:
        os.close(f.fd)


def test_a_helpers_part_out_of_the_page_cache_or_cut_short_is_not_served(
    opened: tuple[Path, Opened], small_parts: None
) -> None:
    path, f = opened
    drop_from_page_cache(path)
    fd = os.open(path, os.O_RDONLY)
    try:  # only the header and the first part back in memory (no read-ahead)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.pread(fd, f.header.start + resident.PIECE, 0)
    finally:
        os.close(fd)
    assert not resident.read_resident(f, scattered(N, 5)[1], 3, at_once)
    path.read_bytes()
    os.truncate(path, f.header.start + 2 * resident.PIECE)  # the last part cut, after the header
    with pytest.raises(BadFile) as exc:
        resident.read_resident(f, scattered(N, 5)[1], 3, at_once)
    assert exc.value.kind == "truncated"


def test_parts_no_helper_took_are_copied_here_and_never_after_the_read_returned(
    opened: tuple[Path, Opened], payload: bytes, small_parts: None
) -> None:
    _, f = opened
    late: list[Callable[[], object]] = []  # a pool that is busy (or stuck): its calls run later
    mem, views = scattered(N, 9)
    assert resident.read_resident(f, views, 3, lambda fn: late.append(fn)) and len(late) == 2
    assert b"".join(bytes(v) for v in views) == payload
    mem[:] = bytes(len(mem))
    for fn in late:
        fn()  # the helpers wake up at last: nothing left for them to copy
    assert not any(mem)


def test_parts_on_a_real_pool_land_whole(
    opened: tuple[Path, Opened], payload: bytes, small_parts: None
) -> None:
    _, f = opened
    pool = DiskPool(3, 5.0)
    pool.start()
    try:
        for _ in range(20):  # (whoever takes each part: the same bytes)
            _, views = scattered(N, 37)
            assert resident.read_resident(f, views, 4, pool.submit)
            assert b"".join(bytes(v) for v in views) == payload
    finally:
        pool.stop()
        pool.join()
