"""Clearing a model's chunks: the admin route `POST /v1/cache/clear` and the engine's CLEAR_SCOPE
(`ScopeLookup.clear`, what the vLLM connector's reset sends), against a real data plane with a
file tier and a real redis-server beneath L1: every tier loses the model's chunks, and only its."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from dataplane.client.keys import key_context
from dataplane.client.vllm.lookup import Scope, ScopeLookup
from dataplane.server.runtime import DataPlane
from dataplane.storage.fs.layout import chunk_path
from dataplane.storage.keys import chunk_keys
from dataplane.wire.blocks import EngineBlocks
from dataplane.wire.kinds import KVFormat
from tests.app.conftest import AUTH, CHUNK, LAYOUT, AppFactory, DataPlaneFactory, Worker, WorkerFactory
from tests.app.test_fake_dataplane import metric_value
from tests.redis_server import RedisServer

TOKENS = np.arange(4 * CHUNK, dtype=np.int64) + 7  # four chunks
BLOCKS = np.arange(4, dtype=np.int64)
LAYERS, _, BLOCK, HEADS, DIM = LAYOUT


def scope(model: str) -> Scope:
    return Scope(model, 1, "bfloat16", LAYERS, HEADS, DIM, KVFormat.TOKEN_MAJOR, BLOCK)


@pytest.fixture
def tiered(make_dp: DataPlaneFactory, tmp_path: Path, redis_server: RedisServer) -> DataPlane:
    fs = tmp_path / "fs"
    fs.mkdir()
    return make_dp(fs_path=fs, fs_size_gb=0.0625, remote_url=redis_server.url)


@pytest.fixture
def tiered_worker(tiered: DataPlane) -> WorkerFactory:
    made: list[Worker] = []
    from dataplane.client import WorkerAdapter, allocate_kv_caches

    def make(model: str = "m") -> Worker:
        w = WorkerAdapter(tiered.server.bound_endpoint, model_name=model, request_timeout=10.0)
        caches = allocate_kv_caches(*LAYOUT, dtype=torch.bfloat16)
        for c in caches:
            c.copy_(torch.randn_like(c, dtype=torch.float32).to(torch.bfloat16))
        w.register_kv_caches(caches)
        made.append(Worker(w, caches))
        return made[-1]

    yield make  # type: ignore[misc]
    for w in made:
        w.adapter.close()


def stored_everywhere(dp: DataPlane, workers: list[Worker]) -> None:
    for w in workers:
        assert w.adapter.store(TOKENS, BLOCKS)
    assert dp.fs is not None and dp.fs.flush(10)
    assert dp.remote is not None and dp.remote.flush(10)


def tiers(client: httpx.Client, model: str, **context: str) -> dict[str, int]:
    item = {"model": model, "token_ids": TOKENS.tolist(), **context}
    r = client.post("/v1/lookup", json={"requests": [item]})
    assert r.status_code == 200, r.text
    got = r.json()["results"][0]
    return {k: got[k] for k in ("cpu_tokens", "disk_tokens", "external_tokens")}


ALL = {"cpu_tokens": 64, "disk_tokens": 64, "external_tokens": 64}
NONE = {"cpu_tokens": 0, "disk_tokens": 0, "external_tokens": 0}


def test_the_admin_clear_removes_a_models_chunks_from_every_tier_and_only_its(
    tiered: DataPlane,
    tiered_worker: WorkerFactory,
    serve_app: AppFactory,
    redis_server: RedisServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    a, b = tiered_worker("m"), tiered_worker("other")
    stored_everywhere(tiered, [a, b])
    client = serve_app(tiered)
    assert tiers(client, "m") == ALL and tiers(client, "other") == ALL
    keys_before = len(redis_server.client().keys("kvwarden:*"))
    with caplog.at_level(logging.WARNING):
        r = client.post("/v1/cache/clear", json={"model": "m"}, headers=AUTH)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got == {
        "model": "m",
        "scopes": 1,
        "removed": 12,
        "l1": 4,
        "fs": 4,
        "remote": 4,
        "pinned": 0,
        "failed": [],
        "complete": True,
    }
    assert tiers(client, "m") == NONE and tiers(client, "other") == ALL
    assert a.adapter.lookup(TOKENS) == 0 and b.adapter.lookup(TOKENS) == 64
    assert len(redis_server.client().keys("kvwarden:*")) == keys_before - 4
    assert a.adapter.retrieve(TOKENS, BLOCKS) == 0  # nothing comes back from any tier
    text = client.get("/metrics").text
    assert metric_value(text, "kvwarden_cache_clears_total", origin="admin", outcome="complete") == 1
    for tier in ("l1", "fs", "remote"):
        assert metric_value(text, "kvwarden_cleared_chunks_total", tier=tier) == 4
    lines = [rec.getMessage() for rec in caplog.records]
    assert any("audit: admin clear_cache" in m and "outcome=200" in m and "removed 12" in m for m in lines)
    assert any(m.startswith("clear: admin") and "'m'" in m for m in lines)
    # the model stores again after the clear, and hits
    assert a.adapter.store(TOKENS, BLOCKS) and a.adapter.lookup(TOKENS) == 64


def test_the_admin_clear_refuses_what_it_cannot_do(tiered: DataPlane, serve_app: AppFactory) -> None:
    client = serve_app(tiered)
    assert client.post("/v1/cache/clear", json={"model": "m"}).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert client.post("/v1/cache/clear", json={"model": "m"}, headers=wrong).status_code == 401
    r = client.post("/v1/cache/clear", json={"model": "m", "namespace": "ab"}, headers=AUTH)
    assert r.status_code == 422 and "namespace: name the LoRA adapter instead ('adapter'" in r.text
    assert client.post("/v1/cache/clear", json={"model": "m", "salt": ""}, headers=AUTH).status_code == 422
    r = client.post("/v1/cache/clear", json={"model": "m", "extra": 1}, headers=AUTH)
    assert r.status_code == 422 and "extra" in r.text
    assert client.post("/v1/cache/clear", json={"model": ""}, headers=AUTH).status_code == 422
    r = client.post("/v1/cache/clear", json={"model": "never-registered"}, headers=AUTH)
    assert r.status_code == 404 and "registered since this server started" in r.json()["detail"]


def test_the_admin_clear_of_a_salt_or_an_adapter_removes_theirs_alone_from_every_tier(
    tiered: DataPlane,
    tiered_worker: WorkerFactory,
    serve_app: AppFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    w = tiered_worker("m")
    hashes = tuple(range(900, 900 + len(TOKENS) // LAYOUT[2]))  # the engine's names of the blocks
    contexts = {  # (the request's salt, adapter) -> its key context and the engine's names
        (None, None): (None, None),
        ("tenant-a", None): (key_context("tenant-a"), None),
        ("tenant-b", None): (key_context("tenant-b"), None),
        ("tenant-b", "lora-x"): (
            key_context("tenant-b", b"ns-of-lora-x"),
            EngineBlocks(LAYOUT[2], hashes, "lora-x"),
        ),
    }
    for key, names in contexts.values():
        assert w.adapter.store(TOKENS, BLOCKS, key, names)
    assert tiered.fs is not None and tiered.fs.flush(10)
    assert tiered.remote is not None and tiered.remote.flush(10)
    client = serve_app(tiered)

    def held(salt: str | None, adapter: str | None) -> dict[str, int]:
        return tiers(client, "m", **{k: v for k, v in (("salt", salt), ("adapter", adapter)) if v})

    assert all(held(*c) == ALL for c in contexts)

    def clear(**body: str) -> dict[str, object]:
        r = client.post("/v1/cache/clear", json={"model": "m", **body}, headers=AUTH)
        assert r.status_code == 200, r.text
        return dict(r.json())

    with caplog.at_level(logging.WARNING):
        got = clear(salt="tenant-a")
    assert (got["l1"], got["fs"], got["remote"], got["complete"]) == (4, 4, 4, True)
    assert held("tenant-a", None) == NONE
    assert held(None, None) == held("tenant-b", None) == held("tenant-b", "lora-x") == ALL
    got = clear(adapter="lora-x")  # under any salt
    assert (got["l1"], got["fs"], got["remote"]) == (4, 4, 4)
    assert held("tenant-b", "lora-x") == NONE and held(None, None) == held("tenant-b", None) == ALL
    got = clear(salt="tenant-b", adapter="lora-x")  # nothing of that context is left
    assert got["removed"] == 0 and got["complete"] is True
    got = clear()  # the model: the unsalted chunks and tenant-b's
    assert (got["l1"], got["fs"], got["remote"]) == (8, 8, 8)
    assert all(held(*c) == NONE for c in contexts)
    r = client.post("/v1/cache/clear", json={"model": "m", "adapter": "never-used"}, headers=AUTH)
    assert r.status_code == 404 and "its namespace is not known" in r.json()["detail"]
    lines = [rec.getMessage() for rec in caplog.records]
    assert any("audit: admin clear_cache" in m and "one salt: removed 12" in m for m in lines)
    assert not any("tenant-a" in m for m in lines)  # a salt is never written out
    # a tenant's chunks stored again after its clear hit again, in every tier
    assert w.adapter.store(TOKENS, BLOCKS, key_context("tenant-a"))
    assert w.adapter.lookup(TOKENS, key_context("tenant-a")) == 64


def test_an_engines_clear_scope_empties_every_tier_of_its_scope(
    tiered: DataPlane, tiered_worker: WorkerFactory, serve_app: AppFactory
) -> None:
    a, b = tiered_worker("m"), tiered_worker("other")
    stored_everywhere(tiered, [a, b])
    client = serve_app(tiered)
    lookup = ScopeLookup(tiered.server.bound_endpoint, scope("m"), timeout_s=5.0)
    try:
        assert lookup.find(TOKENS).hit == 64
        assert lookup.clear() is True
        assert lookup.find(TOKENS).hit == 0
    finally:
        lookup.close()
    assert tiers(client, "m") == NONE and tiers(client, "other") == ALL
    text = client.get("/metrics").text
    assert metric_value(text, "kvwarden_cache_clears_total", origin="engine", outcome="complete") == 1


def test_a_clear_with_redis_down_is_reported_incomplete(
    tiered: DataPlane, tiered_worker: WorkerFactory, serve_app: AppFactory, redis_server: RedisServer
) -> None:
    a = tiered_worker("m")
    stored_everywhere(tiered, [a])
    client = serve_app(tiered)
    redis_server.stop()  # the remote tier's chunks cannot be removed now: the clear must not pass
    r = client.post("/v1/cache/clear", json={"model": "m"}, headers=AUTH)
    assert r.status_code == 503, r.text
    got = r.json()
    assert got["complete"] is False and got["failed"] == ["redis"]
    assert (got["l1"], got["fs"]) == (4, 4)  # what could go went
    lookup = ScopeLookup(tiered.server.bound_endpoint, scope("m"), timeout_s=5.0)
    try:
        assert lookup.clear() is False  # the engine's reset fails likewise
    finally:
        lookup.close()


def test_a_scope_lookup_tells_which_tier_holds_which_part_of_the_prefix(
    tiered: DataPlane, tiered_worker: WorkerFactory
) -> None:
    a = tiered_worker("m")
    stored_everywhere(tiered, [a])
    scope_key = tiered.transfer.registry.scope_of(a.id)
    assert scope_key is not None and tiered.fs is not None
    keys = chunk_keys(scope_key, TOKENS, CHUNK)
    assert tiered.l1.discard(keys[1:]) == 3  # L1 keeps the first chunk
    tiered.fs.index.forget(keys[3])  # the file tier the first three
    os.remove(chunk_path(str(tiered.fs.root), scope_key, keys[3]))
    lookup = ScopeLookup(tiered.server.bound_endpoint, scope("m"), timeout_s=5.0)
    try:
        found = lookup.find(TOKENS)
    finally:
        lookup.close()
    assert (found.hit, found.l1, found.fs) == (64, CHUNK, 2 * CHUNK)  # and Redis the last
