"""Key contexts through a real data plane (`build_dataplane`, real ZMQ, real shared memory) and
real `WorkerAdapter`s of every transfer mode: a chunk stored under a tenant's salt, a LoRA
adapter or a multimodal span is found, counted and served only under the same context.

The client's key builders (`dataplane.client.keys`) are checked here too: an adapter reloaded
in place under the same name and path keys differently; what cannot be keyed raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from dataplane.client import WorkerAdapter, allocate_kv_caches
from dataplane.client.keys import (
    UninterpretableKey,
    adapter_namespace,
    embeds_spans,
    key_context,
    merge_spans,
    mm_spans,
)
from dataplane.client.vllm.lookup import Scope, ScopeLookup
from dataplane.server.config import Settings
from dataplane.server.runtime import DataPlane, build_dataplane
from dataplane.storage.l1 import arena as arena_module
from dataplane.wire.messages import KeyContext, KVFormat
from tests.helpers import free_port

CS = 32
LAYERS, BLOCKS, BS, HEADS, HD = 2, 64, 16, 2, 8
N = 4 * CS  # four full chunks
MODES = ["server_driven", "engine_driven", "engine_driven_pool"]


@pytest.fixture
def make_dp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[bool], DataPlane]]:
    made: list[DataPlane] = []

    def make(private: bool) -> DataPlane:
        with monkeypatch.context() as m:
            if private:  # no room for a shared arena: engine-driven workers go through the pool
                m.setattr(arena_module, "_room_in", lambda _dir: 0)
            d = build_dataplane(
                Settings(port=free_port(), http_port=free_port(), chunk_size=CS, l1_size_gb=0.01)
            )
        d.start()
        made.append(d)
        return d

    yield make
    for d in made:
        d.stop()


class Pair:
    """Two workers of one model on one data plane: ``a`` stores, ``b`` looks up and retrieves."""

    def __init__(self, dp: DataPlane, mode: str) -> None:
        transfer = "server_driven" if mode == "server_driven" else "engine_driven"
        self.src = self._caches(transfer, fill=True)
        self.dst = self._caches(transfer, fill=False)
        url = dp.server.bound_endpoint
        self.a = WorkerAdapter(url, "m", transfer_mode=transfer)
        self.b = WorkerAdapter(url, "m", transfer_mode=transfer)
        self.a.register_kv_caches(self.src)
        self.b.register_kv_caches(self.dst)
        self.blocks = np.arange(N // BS)

    @staticmethod
    def _caches(transfer: str, fill: bool) -> list[torch.Tensor]:
        if transfer == "server_driven":
            out = allocate_kv_caches(LAYERS, BLOCKS, BS, HEADS, HD, torch.bfloat16, "cpu")
        else:
            out = [torch.zeros(2, BLOCKS, BS, HEADS, HD, dtype=torch.bfloat16) for _ in range(LAYERS)]
        for c in out:
            c.copy_(torch.randn(c.shape).to(c.dtype) if fill else torch.zeros(c.shape, dtype=c.dtype))
        return out

    def got(self, n: int) -> bool:
        """The first ``n`` tokens of ``b``'s blocks hold ``a``'s bytes."""
        m = n // BS
        return all(torch.equal(x[:, :m], y[:, :m]) for x, y in zip(self.src, self.dst, strict=True))

    def untouched(self) -> bool:
        return all(not bool(c.any()) for c in self.dst)

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture(params=MODES)
def pair(request: pytest.FixtureRequest, make_dp: Callable[[bool], DataPlane]) -> Iterator[Pair]:
    dp = make_dp(request.param == "engine_driven_pool")
    p = Pair(dp, request.param)
    yield p
    p.close()


TOKENS = np.random.default_rng(3).integers(0, 50_000, N + 5)


def test_a_salted_prefix_is_invisible_to_every_other_salt_and_to_none(pair: Pair) -> None:
    a_ctx, b_ctx = key_context(salt="tenant-a"), key_context(salt="tenant-b")
    assert pair.a.store_detail(TOKENS, pair.blocks, a_ctx).stored == 4
    for other in (None, b_ctx, key_context(salt="tenant-a "), KeyContext(namespace=b"tenant-a")):
        assert pair.b.lookup(TOKENS, other) == 0
        assert pair.b.retrieve(TOKENS, pair.blocks, other) == 0
    assert pair.untouched()  # a miss wrote nothing
    assert pair.b.lookup(TOKENS, a_ctx) == N
    assert pair.b.retrieve(TOKENS, pair.blocks, a_ctx) == N and pair.got(N)
    # stored without a salt: no tenant sees it either
    assert pair.a.store_detail(TOKENS, pair.blocks).stored == 4
    assert pair.b.lookup(TOKENS, b_ctx) == 0 and pair.b.lookup(TOKENS) == N


def test_an_adapters_chunks_are_served_only_to_that_adapter(pair: Pair, tmp_path: Path) -> None:
    lora_a, lora_b = tmp_path / "a", tmp_path / "b"
    for d, w in ((lora_a, b"A" * 64), (lora_b, b"B" * 64)):
        d.mkdir()
        (d / "adapter_model.safetensors").write_bytes(w)
    ctx_a = key_context(adapter=adapter_namespace("sql", lora_a))
    ctx_b = key_context(adapter=adapter_namespace("chat", lora_b))
    assert pair.a.store_detail(TOKENS, pair.blocks).stored == 4  # the base model's
    assert pair.b.lookup(TOKENS, ctx_a) == pair.b.lookup(TOKENS, ctx_b) == 0
    assert pair.a.store_detail(TOKENS, pair.blocks, ctx_a).stored == 4
    assert pair.b.lookup(TOKENS, ctx_b) == 0 and pair.b.lookup(TOKENS, ctx_a) == N
    # the same name and path, its weights rewritten in place: another adapter
    (lora_a / "adapter_model.safetensors").write_bytes(b"C" * 65)
    reloaded = key_context(adapter=adapter_namespace("sql", lora_a))
    assert reloaded != ctx_a and pair.b.lookup(TOKENS, reloaded) == 0


def test_a_span_keys_the_chunks_from_where_it_starts(pair: Pair) -> None:
    image = key_context(spans=mm_spans([("img-1", 2 * CS + 3, 20)]))
    assert pair.a.store_detail(TOKENS, pair.blocks, image).stored == 4
    assert pair.b.lookup(TOKENS) == 2 * CS  # the text before the image is shared
    other = key_context(spans=mm_spans([("img-2", 2 * CS + 3, 20)]))
    assert pair.b.lookup(TOKENS, other) == 2 * CS
    assert pair.b.retrieve(TOKENS, pair.blocks, image) == N and pair.got(N)


def test_lookup_scope_answers_under_the_requests_context(make_dp: Callable[[bool], DataPlane]) -> None:
    dp = make_dp(False)
    p = Pair(dp, "engine_driven")
    scope = Scope("m", 1, "bfloat16", LAYERS, HEADS, HD, KVFormat.TOKEN_MAJOR, BS)
    lookup = ScopeLookup(dp.server.bound_endpoint, scope)
    try:
        ctx = key_context(salt="tenant-a")
        p.a.store(TOKENS, p.blocks, ctx)
        assert lookup.hit_tokens(TOKENS, ctx) == N
        assert lookup.hit_tokens(TOKENS) == lookup.hit_tokens(TOKENS, key_context(salt="x")) == 0
    finally:
        lookup.close()
        p.close()


# ------------------------------------------------------------------ the client's key builders


def test_key_context_of_nothing_is_none_and_long_salts_stay_apart() -> None:
    assert key_context() is None and key_context(salt="", adapter=b"", spans=()) is None
    long_a, long_b = "a" * 300 + "1", "a" * 300 + "2"
    ca, cb = key_context(salt=long_a), key_context(salt=long_b)
    assert ca is not None and cb is not None and ca.salt != cb.salt and len(ca.salt) <= 256


def test_what_cannot_be_keyed_raises(tmp_path: Path) -> None:
    with pytest.raises(UninterpretableKey, match="cannot be read"):
        adapter_namespace("x", tmp_path / "missing")
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(UninterpretableKey, match="holds no weights file"):
        adapter_namespace("x", tmp_path)
    with pytest.raises(UninterpretableKey, match="cannot be keyed"):
        mm_spans([("", 0, 4)])


def test_an_adapter_digest_is_read_once_until_a_file_changes(tmp_path: Path) -> None:
    w = tmp_path / "adapter_model.safetensors"
    w.write_bytes(b"w" * 100)
    first = adapter_namespace("x", tmp_path)
    assert adapter_namespace("x", tmp_path) == first
    assert adapter_namespace("y", tmp_path) != first  # the name is part of it
    w.unlink()  # replaced in place by a file of the same name and size
    w.write_bytes(b"v" * 100)
    assert adapter_namespace("x", tmp_path) != first


def test_embeds_and_multimodal_spans() -> None:
    emb = torch.arange(10 * 4, dtype=torch.float32).reshape(10, 4)
    spans = embeds_spans(emb, 4)
    assert [(s, e) for s, e, _ in spans] == [(0, 4), (4, 8), (8, 10)]
    other = emb.clone()
    other[5, 0] += 1
    changed = [a[2] != b[2] for a, b in zip(spans, embeds_spans(other, 4), strict=True)]
    assert changed == [False, True, False]
    mm = mm_spans([("img", 2, 5)])
    merged = merge_spans([*spans, *mm])  # an image over embeddings: disjoint pieces, both digests
    assert [(s, e) for s, e, _ in merged] == [(0, 2), (2, 4), (4, 7), (7, 8), (8, 10)]
    assert merged[1][2] not in {spans[0][2], mm[0][2]}
    assert merge_spans(spans) == tuple(spans)
