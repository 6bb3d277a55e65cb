"""Tenant shares end to end: a real `kvwarden serve --l1-tenant-share`, real workers storing
under two salts over the wire; one tenant's burst leaves the other's prefix in place, and
/status and /metrics show each tenant under a label that is not its salt."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import numpy as np
import torch

from dataplane.client import WorkerAdapter, allocate_kv_caches
from dataplane.client.keys import key_context
from tests.helpers import ServerProcess

CHUNK = 16
LAYERS, BLOCKS, BS, HEADS, HD = 2, 64, 16, 2, 8
CHUNK_BYTES = LAYERS * 2 * CHUNK * HEADS * HD * 2  # bfloat16
L1_CHUNKS = 40


def test_a_tenants_burst_evicts_only_its_own_chunks_and_is_shown_by_label(
    make_server: Callable[..., ServerProcess],
) -> None:
    gb = L1_CHUNKS * CHUNK_BYTES / (1 << 30)
    srv = make_server("--chunk-size", str(CHUNK), "--l1-size-gb", repr(gb), "--l1-tenant-share", "0.5")
    caches = allocate_kv_caches(LAYERS, BLOCKS, BS, HEADS, HD, torch.bfloat16, "cpu")
    w = WorkerAdapter(srv.endpoint, "m")
    w.register_kv_caches(caches)
    a, b = key_context(salt="salt-alpha-7f3e"), key_context(salt="salt-beta-91c2")
    rng = np.random.default_rng(5)
    blocks = np.arange(4)
    try:
        b_prompt = rng.integers(0, 50_000, 4 * CHUNK)
        assert w.store_detail(b_prompt, blocks, b).stored == 4
        # tenant a stores 60 chunks' worth of prompts: more than all of L1
        for _ in range(15):
            assert w.store_detail(rng.integers(0, 50_000, 4 * CHUNK), blocks, a).rejected == 0
        assert w.lookup(b_prompt, b) == 4 * CHUNK  # b's prefix is still there
        assert w.retrieve(b_prompt, blocks, b) == 4 * CHUNK
        assert w.lookup(b_prompt, a) == w.lookup(b_prompt) == 0  # and only b's

        http = f"http://127.0.0.1:{srv.http_port}"
        l1 = httpx.get(f"{http}/status", timeout=10).json()["storage"]["l1"]
        assert l1["tenant_share_bytes"] == int(0.5 * int(gb * (1 << 30)))
        tenants = {t["tenant"]: t for t in l1["tenants"]}
        assert len(tenants) == 2 and all(t.startswith("t-") for t in tenants)
        by_bytes = sorted(tenants.values(), key=lambda t: t["bytes"])
        small, big = by_bytes
        assert (small["chunks"], small["hits"], small["evictions"]) == (4, 4, 0)  # b: its 4 served
        assert big["chunks"] == L1_CHUNKS // 2 and big["evictions"] == 60 - L1_CHUNKS // 2
        # L1 never filled: every eviction kept a tenant within its share; b's RETRIEVE hit L1
        assert l1["evictions_by_reason"] == {"capacity": 0, "tenant_share": 60 - L1_CHUNKS // 2}
        assert l1["evictions"] == 60 - L1_CHUNKS // 2 and l1["hits"] == 4
        metrics = httpx.get(f"{http}/metrics", timeout=10).text
        assert f'kvwarden_l1_tenant_bytes{{tenant="{small["tenant"]}"}} {float(small["bytes"])}' in metrics
        assert f'kvwarden_l1_tenant_evictions_total{{tenant="{big["tenant"]}"}}' in metrics
        assert 'kvwarden_l1_evictions_by_reason_total{reason="tenant_share"} 40.0' in metrics
        assert "kvwarden_l1_hits_total 4.0" in metrics
        assert not any(s in metrics + str(l1) for s in ("alpha", "beta", "salt-"))
    finally:
        w.close()
