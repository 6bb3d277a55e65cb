"""A disaggregated prefill through ``kvwarden proxy``, with real vLLM OpenAI servers (vLLM's CPU
build, their own prefix caches off): a prefill engine (``kv_producer``, storing each prompt's
tail: ``kvwarden.store_tail``) and a decode engine (``kv_consumer``) on one real ``kvwarden
serve``. The prefill answers with ``kv_transfer_params`` naming what it stored (and stores it
before it answers); the decode engine loads the whole prompt but its last token and computes
that one alone, stores nothing, and answers what a single engine without kvwarden answers.
Handed the full chunks alone (a producer without the tail option), it loads those and computes
the rest; given no params, it loads what the server holds (a chunk in common with another
prompt). The roles hold throughout: the producer never loads (a prompt the server holds is
computed again), the consumer never stores. Both engines' own ``/metrics`` carry kvwarden's figures
(through vLLM's connector stats), equal to what the server counted, and the decode engine's
hits are reported by the tier they came from (``vllm:prompt_tokens_cached_by_source``)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.vllm_support import (
    CHUNK,
    FULL,
    PROMPT,
    SHARES_ONE,
    OpenAIServer,
    Reference,
    model_with_tokenizer,
    serve,
    words_to_ids,
)
from tests.helpers import ROOT, free_port, subprocess_env, wait_until

pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("vllm")]  # one worker: the vLLM engines


def samples(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def _bytes(srv_http: int, direction: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{srv_http}/metrics", timeout=10).text
    return samples(text, "kvwarden_transfer_bytes_total", direction=direction)


def _vllm_metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


def test_a_prefill_handed_off_through_the_proxy_is_decoded_from_its_chunks(
    reference: Reference, tmp_path: Path
) -> None:
    model = model_with_tokenizer(reference, tmp_path)
    srv = serve(tmp_path / "server")
    started: list[OpenAIServer] = []
    proxy: subprocess.Popen[bytes] | None = None
    try:
        prefill = OpenAIServer(
            model, srv.endpoint, "kv_producer", tmp_path / "prefill.log", {"kvwarden.store_tail": True}
        )
        started.append(prefill)
        decode = OpenAIServer(model, srv.endpoint, "kv_consumer", tmp_path / "decode.log")
        started.append(decode)
        port = free_port()
        cmd = [sys.executable, "-m", "app.cli", "proxy", "--prefill", prefill.url, "--decode", decode.url]
        with open(tmp_path / "proxy.log", "wb") as log:
            proxy = subprocess.Popen(
                [*cmd, "--port", str(port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=subprocess_env(),
            )
        url = f"http://127.0.0.1:{port}"

        def proxy_up() -> bool:
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(proxy_up, 60, what="the proxy")
        body = {"model": "m", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        with httpx.Client(timeout=300) as client:
            t0 = time.perf_counter()
            r = client.post(url + "/v1/completions", json=body)
            through_proxy_s = time.perf_counter() - t0
        assert r.status_code == 200, r.text
        out = r.json()
        cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == len(PROMPT) - 1  # the prefill's chunks and its tail: the decode computed one token
        assert words_to_ids(out["choices"][0]["text"]) == reference.tokens["prompt"]
        stored = _bytes(srv.http_port, "store")
        assert stored > 0 and _bytes(srv.http_port, "retrieve") > 0
        # the decode engine, a consumer, stores nothing; a second request through the proxy
        # finds the prefill's chunks again and the store count grows by nothing new
        with httpx.Client(timeout=300) as client:
            again = client.post(url + "/v1/completions", json=body).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT) - 1
        assert _bytes(srv.http_port, "store") == stored
        # handed the full chunks alone (what a producer without the tail option names), the
        # decode engine loads those and computes the tail itself
        with httpx.Client(timeout=300) as client:
            pre = client.post(prefill.url + "/v1/completions", json=dict(body, max_tokens=1)).json()
            # held by the server, but a producer never loads
            assert pre["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            params = pre["kv_transfer_params"]
            assert params["kvwarden"]["tokens"] == len(PROMPT) - 1  # the prefill names its tail
            params["kvwarden"]["tokens"] = FULL
            r = client.post(decode.url + "/v1/completions", json=dict(body, kv_transfer_params=params))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == FULL
        assert words_to_ids(r.json()["choices"][0]["text"]) == reference.tokens["prompt"]
        # without params, a consumer loads what is held (one chunk in common), and stores
        # nothing of the rest
        with httpx.Client(timeout=300) as client:
            r = client.post(decode.url + "/v1/completions", json=dict(body, prompt=SHARES_ONE))
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == CHUNK
        assert _bytes(srv.http_port, "store") == stored
        retrieved = _bytes(srv.http_port, "retrieve")
        hits = 2 * (len(PROMPT) - 1) + FULL + CHUNK
        # vLLM's /metrics: the decode engine's lookups and loads, the prefill engine's stores
        wait_until(
            lambda: samples(_vllm_metrics(decode.url), "vllm:kvwarden_loads_total", outcome="full") == 4,
            60,
            what="the decode engine's loads in its metrics",
        )
        d, p = _vllm_metrics(decode.url), _vllm_metrics(prefill.url)
        assert samples(d, "vllm:kvwarden_lookups_total", outcome="hit") == 4
        assert samples(d, "vllm:kvwarden_lookups_total") == 4  # (no miss, none unanswered)
        assert samples(d, "vllm:kvwarden_loads_total", outcome="short") == 0
        assert samples(d, "vllm:kvwarden_loaded_tokens_total") == hits
        assert samples(d, "vllm:kvwarden_loaded_bytes_total") == retrieved  # what the server moved
        assert (
            samples(d, "vllm:kvwarden_load_seconds_count") == 4
            and samples(d, "vllm:kvwarden_load_seconds_sum") > 0
        )
        assert samples(d, "vllm:kvwarden_stored_chunks_total") == 0  # a consumer
        # every hit came from the server's L1: vLLM's own cached-token counts say so
        assert samples(d, "vllm:prompt_tokens_cached_by_source_total", source="host") == hits
        assert samples(d, "vllm:prompt_tokens_cached_by_source_total", source="external_unspecified") == 0
        wait_until(
            lambda: samples(_vllm_metrics(prefill.url), "vllm:kvwarden_stored_chunks_total") == 5,
            60,
            what="the prefill engine's stores in its metrics",
        )
        p = _vllm_metrics(prefill.url)
        assert samples(p, "vllm:kvwarden_stored_bytes_total") == stored  # what the server took
        assert samples(p, "vllm:kvwarden_lookups_total") == 0 and samples(p, "vllm:kvwarden_loads_total") == 0
        assert samples(p, "vllm:kvwarden_failed_stores_total") == 0
        print(
            f"handoff: {through_proxy_s:.3f} s through the proxy (prefill and decode of {len(PROMPT)} tokens)"
        )
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(30)
        for s in started:
            s.stop()
        srv.stop()
