"""/metrics: every contract metric (remote tier aside), scrape-time gauges, promtool-clean."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from dataplane.client import WorkerAdapter, allocate_kv_caches
from dataplane.server.runtime import DataPlane
from dataplane.wire.errors import LimitExceeded
from dataplane.wire.protocol import encode_message
from tests.app.conftest import (
    AUTH,
    CHUNK,
    LAYOUT,
    AppFactory,
    DataPlaneFactory,
    WorkerFactory,
)
from tests.conftest import DealerFactory
from tests.helpers import call, error_of, next_rid

CONTRACT = {
    # gauges
    "kvwarden_healthy": "gauge",
    "kvwarden_tracked_instances": "gauge",
    "kvwarden_l1_used_bytes": "gauge",
    "kvwarden_l1_capacity_bytes": "gauge",
    # counters (family names, exposed with _total)
    "kvwarden_instances_reaped": "counter",
    "kvwarden_pings": "counter",
    "kvwarden_requests": "counter",
    "kvwarden_transfer_bytes": "counter",
    "kvwarden_lookup_tokens": "counter",
    "kvwarden_hit_tokens": "counter",
    "kvwarden_l1_evictions": "counter",
    # histogram
    "kvwarden_request_duration_seconds": "histogram",
}


def scrape(client: httpx.Client) -> tuple[str, dict[str, dict[tuple[tuple[str, str], ...], float]]]:
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return r.text, samples


def families(text: str) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def test_every_contract_metric_is_exposed(client: httpx.Client, make_worker: WorkerFactory) -> None:
    w = make_worker()
    w.adapter.heartbeat_once()
    assert w.adapter.store(list(range(2 * CHUNK)), [0, 1])
    text, samples = scrape(client)
    got = families(text)
    for name, kind in CONTRACT.items():
        assert got.get(name) == kind, f"{name}: {got.get(name)}"
    assert samples["kvwarden_healthy"][()] == 1.0
    tracked = samples["kvwarden_tracked_instances"]
    assert tracked == {(("transfer_mode", "server_driven"),): 1.0, (("transfer_mode", "engine_driven"),): 0.0}
    assert samples["kvwarden_l1_used_bytes"][()] > 0
    assert samples["kvwarden_l1_capacity_bytes"][()] > samples["kvwarden_l1_used_bytes"][()]
    assert samples["kvwarden_pings_total"][()] >= 1
    assert samples["kvwarden_transfer_bytes_total"][(("direction", "store"),)] > 0
    reasons = {dict(k)["reason"] for k in samples["kvwarden_instances_reaped_total"]}
    assert reasons == {"timeout", "grace", "disconnect", "admin"}
    # the HTTP metrics of the instrumentator, on this app's registry
    assert any(n.startswith("kvwarden_http_request") for n in got)
    # no per-instance labels anywhere
    assert str(w.id) not in text


def test_metrics_follow_state_at_scrape_time(
    client: httpx.Client, dp: DataPlane, make_worker: WorkerFactory
) -> None:
    a, b = make_worker(), make_worker()
    _, s = scrape(client)
    assert s["kvwarden_tracked_instances"][(("transfer_mode", "server_driven"),)] == 2.0
    assert client.post(f"/instances/{a.id}/reap", headers=AUTH).status_code == 200
    _, s = scrape(client)
    assert s["kvwarden_tracked_instances"][(("transfer_mode", "server_driven"),)] == 1.0
    assert s["kvwarden_instances_reaped_total"][(("reason", "admin"),)] == 1.0
    a.adapter.close()  # UNREGISTER while the server still answers
    b.adapter.close()
    _, s = scrape(client)
    assert s["kvwarden_tracked_instances"][(("transfer_mode", "server_driven"),)] == 0.0
    assert s["kvwarden_healthy"][()] == 1.0
    assert dp.stop()
    _, s = scrape(client)
    assert s["kvwarden_healthy"][()] == 0.0


def test_l1_evictions_are_counted(make_dp: DataPlaneFactory, serve_app: AppFactory) -> None:
    chunk_bytes = LAYOUT[0] * 2 * CHUNK * LAYOUT[3] * LAYOUT[4] * 2  # bf16
    dp = make_dp(l1_size_gb=3 * chunk_bytes / (1 << 30))  # room for three chunks
    c = serve_app(dp)
    with WorkerAdapter(dp.server.bound_endpoint, model_name="m", request_timeout=10) as w:
        w.register_kv_caches(allocate_kv_caches(*LAYOUT, dtype=torch.bfloat16))
        for i in range(8):  # eight one-chunk prompts: the oldest make room for the newest
            assert w.store(list(range(1000 * i, 1000 * i + CHUNK)), [i])
        _, s = scrape(c)
        assert s["kvwarden_l1_hits_total"][()] == 0
        assert w.retrieve(list(range(7000, 7000 + CHUNK)), [0]) == CHUNK  # the newest is there
        assert w.retrieve(list(range(0, CHUNK)), [0]) == 0  # the oldest is not
        _, after = scrape(c)
    assert s["kvwarden_l1_evictions_total"][()] == 5
    reasons = s["kvwarden_l1_evictions_by_reason_total"]
    assert reasons == {(("reason", "capacity"),): 5.0, (("reason", "tenant_share"),): 0.0}
    assert after["kvwarden_l1_hits_total"][()] == 1
    assert 0 < s["kvwarden_l1_used_bytes"][()] <= 3 * chunk_bytes


def test_an_lfuda_server_keeps_the_prompt_read_most_and_says_so(
    make_dp: DataPlaneFactory, serve_app: AppFactory
) -> None:
    chunk_bytes = LAYOUT[0] * 2 * CHUNK * LAYOUT[3] * LAYOUT[4] * 2  # bf16
    dp = make_dp(l1_size_gb=3 * chunk_bytes / (1 << 30), l1_eviction="lfuda")  # three chunks
    c = serve_app(dp)
    hot = list(range(CHUNK))
    with WorkerAdapter(dp.server.bound_endpoint, model_name="m", request_timeout=10) as w:
        w.register_kv_caches(allocate_kv_caches(*LAYOUT, dtype=torch.bfloat16))
        assert w.store(hot, [0])
        for _ in range(2):
            assert w.retrieve(hot, [0]) == CHUNK
        for i in range(1, 4):  # three newer prompts, each read once: LRU lets hot go for the third
            tokens = list(range(1000 * i, 1000 * i + CHUNK))
            assert w.store(tokens, [i])
            assert w.retrieve(tokens, [i]) == CHUNK
        assert w.lookup(hot) == CHUNK
        _, s = scrape(c)
    l1 = c.get("/status").json()["storage"]["l1"]
    assert l1["policy"] == "lfuda" and l1["evictions"] == 1 and l1["hits"] == 5
    assert s["kvwarden_l1_evictions_by_reason_total"][(("reason", "capacity"),)] == 1


def test_limit_and_owner_refusals_are_counted(
    make_dp: DataPlaneFactory, serve_app: AppFactory, make_dealer: DealerFactory
) -> None:
    dp = make_dp(max_instances=1)
    c = serve_app(dp)
    _, s = scrape(c)
    assert s["kvwarden_limits_exceeded_total"][(("limit", "max_instances"),)] == 0  # from the start
    caches = allocate_kv_caches(*LAYOUT, dtype=torch.bfloat16)
    with WorkerAdapter(dp.server.bound_endpoint, model_name="m", request_timeout=10) as w:
        w.register_kv_caches(caches)
        for _ in range(2):  # a second instance does not fit: refused twice, counted twice
            with (
                pytest.raises(LimitExceeded, match="max_instances"),
                WorkerAdapter(dp.server.bound_endpoint, model_name="m", request_timeout=10) as other,
            ):
                other.register_kv_caches(allocate_kv_caches(*LAYOUT, dtype=torch.bfloat16))
        reg = w.registration
        assert reg is not None
        stranger = dataclasses.replace(reg, secret=bytes(16))  # the live id, another secret
        reply = call(make_dealer(dp.server.bound_endpoint), encode_message(next_rid(), stranger))
        assert error_of(reply)[0] == "NOT_OWNER"
        _, s = scrape(c)
    assert s["kvwarden_limits_exceeded_total"][(("limit", "max_instances"),)] == 2
    assert s["kvwarden_limits_exceeded_total"][(("limit", "max_mapped_gb"),)] == 0
    assert s["kvwarden_not_owner_refusals_total"][()] == 1


def test_metrics_pass_promtool(client: httpx.Client, make_worker: WorkerFactory) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is required (Debian package 'prometheus'; `make test` installs it)"
    w = make_worker()
    assert w.adapter.store(list(range(CHUNK)), [0])
    assert client.get("/status").status_code == 200
    assert client.get("/instances/1").status_code == 404
    text = client.get("/metrics").text
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()
    assert proc.stdout.decode().strip() == "", proc.stdout.decode()


def test_apps_have_registries_of_their_own(dp: DataPlane, serve_app: AppFactory) -> None:
    """Two apps over one data plane in one process: no duplicate-registration error, and each
    counts only its own HTTP requests."""
    one, two = serve_app(dp), serve_app(dp)
    for _ in range(3):
        one.get("/livez")
    _, s1 = scrape(one)
    _, s2 = scrape(two)
    livez = (("handler", "/livez"), ("method", "GET"), ("status", "2xx"))
    assert s1["kvwarden_http_requests_total"][livez] == 3.0
    assert livez not in s2.get("kvwarden_http_requests_total", {})
