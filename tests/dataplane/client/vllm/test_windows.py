"""Sliding-window layer groups (vLLM's hybrid KV cache manager on), against a real server: a
group's chunks stored and loaded from an offset chunk, vLLM's null blocks never written,
LOOKUP_SCOPE's window, a hit that every group of an engine can serve, and the plan of which
chunks each group moves."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from dataplane.client.vllm.lookup import Scope, ScopeLookup
from dataplane.client.vllm.state import Planner
from dataplane.client.vllm.wait import LookupFound
from tests.dataplane.client.vllm.test_connector_parts import (
    BS,
    CS,
    LAYERS,
    NB,
    scope,
    server,
    vllm_cpu_caches,
    worker,
)
from tests.helpers import ServerProcess

__all__ = ["server"]  # (the fixture)

PER = CS // BS  # blocks a chunk


def test_a_window_is_stored_and_loaded_from_its_first_chunk_and_never_into_a_null_block(
    server: ServerProcess,
) -> None:
    src, dst = vllm_cpu_caches(1), vllm_cpu_caches(2)
    untouched = [t.clone() for t in dst]
    tokens = np.arange(500, 500 + 4 * CS + 3)
    with worker(server) as w:
        w.register_kv_caches(src, "vllm_cpu")
        held = np.arange(NB)
        held[: 2 * PER] = -1  # chunks 0 and 1: vLLM's null block, outside the window
        counts = w.store_detail(tokens, held, first=2)
        assert (counts.chunks, counts.stored) == (2, 2)  # chunks 2 and 3 alone
    look = ScopeLookup(server.endpoint, scope())
    windowed = ScopeLookup(server.endpoint, replace(scope(), window=2 * CS))  # 2 chunks before the end
    try:
        assert look.hit_tokens(tokens) == 0  # the prefix is not held: no hit for a full-attention group
        assert windowed.hit_tokens(tokens) == 4 * CS  # its window is
        assert windowed.hit_tokens(tokens[: 3 * CS]) == 0  # the window ending at chunk 3 needs chunk 1
        too_wide = ScopeLookup(server.endpoint, replace(scope(), window=3 * CS))
        assert too_wide.hit_tokens(tokens) == 0
        too_wide.close()
    finally:
        look.close()
        windowed.close()
    blocks = np.arange(NB)[::-1].copy()
    blocks[: 2 * PER + 1] = -1  # the null blocks, and the first of chunk 2's (a window mid-chunk)
    with worker(server) as w:
        w.register_kv_caches(dst, "vllm_cpu")
        assert w.retrieve(tokens, blocks, first=2) == 4 * CS
        assert w.retrieve(tokens, blocks, first=1) == CS  # chunk 1 is not there: nothing loaded
    for layer in range(LAYERS):
        for i in range(2 * PER + 1, 4 * PER):
            assert torch.equal(dst[layer][blocks[i]], src[layer][i])
        written = {int(b) for b in blocks[2 * PER + 1 : 4 * PER]}
        for b in set(range(NB)) - written:
            assert torch.equal(dst[layer][b], untouched[layer][b])  # null and other blocks: as they were


def test_a_hit_is_the_prefix_every_group_serves(server: ServerProcess) -> None:
    full, window = scope("m#g0"), replace(scope("m#g1"), window=CS)  # one chunk before the end
    tokens = np.arange(900, 900 + 4 * CS + 1)
    with worker(server, "m#g0") as a, worker(server, "m#g1") as b:
        a.register_kv_caches(vllm_cpu_caches(3), "vllm_cpu")
        b.register_kv_caches(vllm_cpu_caches(4), "vllm_cpu")
        a.store_detail(tokens, np.arange(NB))
        assert b.store_detail(tokens, np.arange(NB), first=3).stored == 1  # the last chunk alone
        look = ScopeLookup(server.endpoint, (full, window))
        try:
            assert look.find(tokens).hit == 4 * CS  # all of the full group, the window's last chunk
            assert look.find(tokens[: 3 * CS]).hit == 0  # ends where the window group holds nothing
            other = np.concatenate([tokens[: 2 * CS], np.arange(7, 7 + 2 * CS)])
            b.store_detail(other, np.arange(NB), first=1)
            assert look.find(other).hit == 2 * CS  # the full group's prefix, and chunk 1's window
        finally:
            look.close()


def _planner(windows: tuple[int, ...], hit: int) -> Planner:
    p = Planner(lambda tokens, key: LookupFound(hit), BS)
    p.chunk_size = lambda: CS
    p.windows = windows
    return p


def test_a_load_moves_each_windows_last_chunks_alone() -> None:
    p = _planner((0, 2 * CS), 4 * CS)
    prompt = list(range(4 * CS + 9))
    assert p.matched("a", prompt, 0) == 4 * CS
    p.allocated("a", prompt, 4 * CS)
    ids = list(range(1, 10))
    nulls = [-1] * 2 * PER + list(range(10, 15))
    (job,) = p.plan([("a", prompt, [ids, nulls], 0, 9)], [], False).loads
    assert job.first == 0 and list(job.blocks) == ids  # full attention: every chunk
    (part,) = job.more
    # the window of 2 x CS tokens ending at token 4 x CS needs chunks 2 and 3
    assert part.first == 2 and list(part.blocks) == nulls


def test_a_window_saves_no_chunk_with_a_null_block_or_one_freed_before_the_save() -> None:
    p = _planner((0, 8), 0)  # an 8-token window: smaller than a chunk
    prompt = list(range(3 * CS + 5))
    p.matched("a", prompt, 0)
    (save,) = p.plan([("a", prompt, [[1, 2, 3], [4, 5, 6]], 0, CS + 8)], [], False).saves
    assert [(part.first, len(part.blocks)) for part in save.parts()] == [(0, PER), (0, PER)]
    # chunk 1 began in the last step: its window group's first blocks went back at this one
    (save,) = p.plan([], [("a", [[7, 8, 9], [10, 11, 12]], False, CS + 8, CS)], False).saves
    assert [part.first for part in save.parts()] == [0, 2]  # (2: nothing of chunk 1)
    # a hit's request: its window's blocks before the hit are vLLM's null block (a CS window at
    # token 2 x CS: its first 33 tokens' whole blocks)
    q = _planner((0, CS), 2 * CS)
    q.matched("b", prompt, 0)
    q.allocated("b", prompt, 2 * CS)
    window = [-1, -1, 20, 21, 22, 23]
    (job,) = (plan := q.plan([("b", prompt, [[1, 2, 3, 4, 5, 6], window], 2 * CS, CS + 5)], [], False)).loads
    assert job.more[0].first == 1  # (chunk 1 alone: tokens 33 .. 63)
    (save,) = plan.saves
    assert len(save.tokens) == 3 * CS and [part.first for part in save.parts()] == [0, 2]
    assert list(save.more[0].blocks) == window


def test_a_scope_names_its_window_in_chunks() -> None:
    s = Scope("m", 1, "bfloat16", 2, 2, 8, scope().kv_format, BS, window=4096)
    assert (s.window_chunks(256), s.first_chunk(8192, 256), s.first_chunk(1000, 256)) == (16, 16, 0)
    assert (replace(s, window=1).window_chunks(256), replace(s, window=0).window_chunks(256)) == (1, 0)
