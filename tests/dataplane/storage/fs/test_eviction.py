"""The file tier's eviction orders (`fs_eviction`) on a real directory, and the index's
invariants under any sequence of uses: its bytes are the sum of its files, the order holds
exactly the files known, and a removal keeps the cap."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane.storage.fs import FileTier
from dataplane.storage.fs.index import FileIndex
from dataplane.storage.fs.layout import PAYLOAD_AT, ScannedFile
from tests.dataplane.storage.fs.test_tier import CHUNK, SCOPE, files, key, payload, read, written_oldest_first
from tests.helpers import wait_until

SIZE = CHUNK + PAYLOAD_AT  # a file: its header, padded to a page, then the chunk


def left(root: Path) -> set[int]:
    return {int(p.name[:4], 16) for p in files(root)}


@pytest.mark.parametrize(("policy", "kept"), [("lru", {1, 2, 3}), ("lfuda", {0, 2, 3})])
def test_a_file_read_often_outlasts_files_read_once_lately_under_lfuda_only(
    tmp_path: Path, policy: str, kept: set[int]
) -> None:
    t = FileTier(str(tmp_path), 3 * SIZE, eviction=policy)
    t.start()
    try:
        for i in range(3):
            assert t.put(SCOPE, key(i), memoryview(payload(i)))
            assert t.flush(10)
        for _ in range(3):
            assert read(t, 0) == payload(0)  # 0: read three times
        assert read(t, 1) == payload(1)  # then 1 and 2 once each, 0 the least recently used
        assert read(t, 2) == payload(2)
        assert t.put(SCOPE, key(3), memoryview(payload(3)))
        assert t.flush(10)
        assert left(tmp_path) == kept
        s = t.stats()
        assert s.policy == policy and s.evictions == 1 and s.files == 3 and s.used_bytes == 3 * SIZE
    finally:
        t.stop()
        t.join()


def test_after_a_restart_lfuda_removes_the_files_found_oldest_first_before_any_used_since(
    tmp_path: Path,
) -> None:
    written_oldest_first(tmp_path, 6)
    b = FileTier(str(tmp_path), 4 * SIZE, eviction="lfuda")
    b.start()
    try:
        wait_until(lambda: b.stats().rebuilt, 10, what="the rebuild")
        assert left(tmp_path) == {2, 3, 4, 5}  # the oldest two went to keep the cap
        assert read(b, 2) == payload(2)  # read here: worth more than any file only found
        assert b.put(SCOPE, key(6), memoryview(payload(6)))
        assert b.flush(10)
        assert left(tmp_path) == {2, 4, 5, 6}  # 3, the oldest found and not used, went
    finally:
        b.stop()
        b.join()


def test_an_unknown_policy_is_refused_naming_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="eviction policy 'fifo': one of lru, lfuda"):
        FileTier(str(tmp_path), 1 << 30, eviction="fifo")


ops = st.lists(
    st.one_of(
        st.tuples(st.just("learn"), st.integers(0, 15), st.integers(1, 9), st.booleans()),
        st.tuples(st.just("forget"), st.integers(0, 15)),
        st.tuples(st.just("evict"), st.integers(0, 20), st.integers(0, 60)),
        st.tuples(st.just("merge"), st.sets(st.integers(0, 15))),
    ),
    max_size=60,
)


@pytest.mark.parametrize("policy", ["lru", "lfuda"])
@settings(max_examples=150, deadline=None)
@given(seq=ops)
def test_the_index_accounts_every_byte_and_keeps_the_cap_whatever_the_uses(
    policy: str, seq: list[tuple]
) -> None:
    idx = FileIndex(policy)
    sizes: dict[bytes, int] = {}  # what the index should know
    for op in seq:
        if op[0] == "learn":
            _, i, size, was_read = op
            k = key(i)
            idx.learn(SCOPE, k, sizes.setdefault(k, size), read=was_read)
        elif op[0] == "forget":
            idx.forget(key(op[1]))
            sizes.pop(key(op[1]), None)
        elif op[0] == "evict":
            _, room, cap = op
            out = idx.victims(room, cap)
            for k, f in out:
                assert sizes.pop(k) == f.size
            assert sum(sizes.values()) + room <= cap or not sizes
        else:
            found = [ScannedFile(SCOPE, key(i), sizes.get(key(i), 5), 1000.0 + i) for i in sorted(op[1])]
            idx.merge(found)
            sizes = {f.key: f.size for f in found}
        n, used = idx.sizes()
        assert n == len(sizes) and used == sum(sizes.values())
        assert all(k in idx for k in sizes)
        if idx._order is not None:
            assert len(idx._order) == n
