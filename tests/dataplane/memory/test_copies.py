"""The copy kernels against a plain-indexing reference: whole blocks (one indexed copy per layer)
and runs of slots (chunks that are not whole blocks), per-layer tensors and one stacked view
(with and without a gap between layers), with and without a splitter."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane.memory.copies import Blocks, ChunkMap, CopySplitter, token_slots, whole_blocks
from dataplane.memory.kvmemory import MappedKV, map_local_tensors

L, NB, BS, H, D = 3, 12, 4, 2, 8


def test_whole_blocks_only_when_every_block_is_whole_and_in_order() -> None:
    assert whole_blocks(token_slots(np.array([5, 2, 7]), BS, NB, 3 * BS), BS).tolist() == [5, 2, 7]
    assert whole_blocks(token_slots(np.array([5, 2]), BS, NB, BS + 1), BS) is None  # a partial block
    assert whole_blocks(np.array([1, 2, 3, 4]), BS) is None  # starts inside block 0
    assert whole_blocks(np.array([4, 5, 7, 6]), BS) is None  # a block's slots out of order
    assert whole_blocks(np.array([], dtype=np.int64), BS) is None


def caches(layout: str) -> list[torch.Tensor]:
    shape = (2, NB, BS, H, D)
    n = 2 * NB * BS * H * D
    if layout == "separate":
        out = [torch.empty(shape, dtype=torch.bfloat16) for _ in range(L)]
    elif layout == "stacked":
        out = list(torch.empty((L, *shape), dtype=torch.bfloat16).unbind(0))
    else:  # stacked at a constant stride with a gap between layers
        flat = torch.empty(L * (n + 64), dtype=torch.bfloat16)
        out = [flat[i * (n + 64) : i * (n + 64) + n].view(shape) for i in range(L)]
    for c in out:
        c.view(torch.int16).random_()
    return out


@pytest.fixture(scope="module")
def splitter() -> Iterator[CopySplitter]:
    s = CopySplitter(2)
    s.start()
    yield s
    s.stop()


def reference_chunk(layers: list[torch.Tensor], slots: np.ndarray) -> torch.Tensor:
    idx = torch.from_numpy(slots)
    return torch.stack([t.view(torch.int16).view(2, NB * BS, H * D)[:, idx] for t in layers])


@settings(max_examples=40, deadline=None)
@given(
    layout=st.sampled_from(["separate", "stacked", "gapped"]),
    blocks=st.lists(st.integers(0, NB - 1), min_size=1, max_size=NB, unique=True),
    cut=st.integers(0, BS - 1),
    split=st.booleans(),
)
def test_gather_and_scatter_match_plain_indexing(
    layout: str, blocks: list[int], cut: int, split: bool, splitter: CopySplitter
) -> None:
    src = caches(layout)
    kv: MappedKV = map_local_tensors(src)
    assert (kv.stacked is not None) == (layout != "separate")
    n = len(blocks) * BS - cut  # cut > 0: the last block partly used (the runs path)
    slots = token_slots(np.array(blocks), BS, NB, n)
    assert (whole_blocks(slots, BS) is not None) == (cut == 0)
    sp = splitter if split else None
    buf = torch.empty(kv.chunk_nbytes(n), dtype=torch.uint8)
    kv.gather(slots, buf, sp)
    want = reference_chunk(src, slots)
    assert torch.equal(buf.view(torch.int16).view(want.shape), want)  # bit for bit (NaNs too)

    dst = caches(layout)
    before = [t.clone() for t in dst]
    map_local_tensors(dst).scatter(slots, buf, sp)
    idx = torch.from_numpy(slots)
    for t, b, w in zip(dst, before, want, strict=True):
        flat, old = (x.view(torch.int16).view(2, NB * BS, H * D) for x in (t, b))
        assert torch.equal(flat[:, idx], w)  # the chunk's slots hold the chunk
        untouched = torch.ones(NB * BS, dtype=torch.bool)
        untouched[idx] = False
        assert torch.equal(flat[:, untouched], old[:, untouched])  # nothing else was written


@settings(max_examples=40, deadline=None)
@given(
    blocks=st.lists(st.integers(0, NB - 1), min_size=1, max_size=NB, unique=True),
    per_chunk=st.sampled_from([BS, 2 * BS, BS // 2, BS + 2]),  # whole blocks, or not
)
def test_chunk_map_places_each_chunk_where_its_tokens_live(blocks: list[int], per_chunk: int) -> None:
    ids = np.array(blocks, dtype=np.int32)  # as block ids arrive off the wire
    n_chunks = len(blocks) * BS // per_chunk
    chunks = ChunkMap(ids, BS, NB, n_chunks, per_chunk)
    slots = token_slots(ids, BS, NB, n_chunks * per_chunk)
    for i in range(n_chunks):
        where = chunks[i]
        assert isinstance(where, Blocks) == (per_chunk % BS == 0)
        got = where.slots() if isinstance(where, Blocks) else where
        assert got.tolist() == slots[i * per_chunk : (i + 1) * per_chunk].tolist()


@pytest.mark.parametrize("per_chunk", [BS, BS + 2])
def test_chunk_map_names_a_missing_or_bad_block_as_token_slots_does(per_chunk: int) -> None:
    for ids, n_chunks in ((np.array([1, 2]), 3), (np.array([1, NB, 2]), 2), (np.array([-1, 2, 3]), 1)):
        with pytest.raises(ValueError) as want:
            token_slots(ids, BS, NB, n_chunks * per_chunk)
        with pytest.raises(ValueError, match="block_ids") as got:
            ChunkMap(ids, BS, NB, n_chunks, per_chunk)
        assert str(got.value) == str(want.value)


@settings(max_examples=30, deadline=None)
@given(
    layout=st.sampled_from(["separate", "stacked", "gapped"]),
    blocks=st.lists(st.integers(0, NB - 1), min_size=1, max_size=NB, unique=True),
    split=st.booleans(),
)
def test_whole_blocks_move_the_same_bytes_as_their_slots(
    layout: str, blocks: list[int], split: bool, splitter: CopySplitter
) -> None:
    src = caches(layout)
    kv = map_local_tensors(src)
    where = Blocks(np.array(blocks, dtype=np.int64), BS)
    sp = splitter if split else None
    by_blocks, by_slots = (torch.empty(kv.chunk_nbytes(len(blocks) * BS), dtype=torch.uint8) for _ in "ab")
    kv.gather(where, by_blocks, sp)
    kv.gather(where.slots(), by_slots, sp)
    assert torch.equal(by_blocks, by_slots)
    dst_a, dst_b = caches(layout), caches(layout)
    for t_a, t_b in zip(dst_a, dst_b, strict=True):
        t_b.copy_(t_a)
    map_local_tensors(dst_a).scatter(where, by_blocks, sp)
    map_local_tensors(dst_b).scatter(where.slots(), by_blocks, sp)
    assert all(
        torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(dst_a, dst_b, strict=True)
    )


@settings(max_examples=40, deadline=None)
@given(
    layout=st.sampled_from(["separate", "stacked", "gapped"]),
    blocks=st.lists(st.integers(0, NB - 1), min_size=1, max_size=NB, unique=True),
    cut=st.integers(0, BS - 1),
)
def test_chunk_views_are_the_workers_memory_in_the_chunks_order(
    layout: str, blocks: list[int], cut: int
) -> None:
    src = caches(layout)
    kv: MappedKV = map_local_tensors(src)
    n = len(blocks) * BS - cut
    slots = token_slots(np.array(blocks), BS, NB, n)
    where = Blocks(np.array(blocks, dtype=np.int64), BS) if cut == 0 else slots
    buf = torch.empty(kv.chunk_nbytes(n), dtype=torch.uint8)
    kv.gather(slots, buf)
    views = kv.chunk_views(where)
    assert views is not None and b"".join(bytes(v) for v in views) == buf.numpy().tobytes()  # read order
    for v in views:  # writable, into the caches themselves
        v[:] = b"\x00" * v.nbytes
    assert all(not t.view(torch.int16).view(2, NB * BS, H * D)[:, torch.from_numpy(slots)].any() for t in src)
    runs = len(np.flatnonzero(np.diff(slots) != 1)) + 1
    assert kv.chunk_views(slots, max_views=2 * L * runs - 1) is None  # too many pieces: not in place
