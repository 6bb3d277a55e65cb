"""A reset after a weight update, with a real vLLM engine (vLLM's CPU build) and a real
``kvwarden serve`` with a file tier and a real redis-server beneath L1: without the reset, the
KV of the old weights is served after the weights changed (what the reset is for); after
``reset_prefix_cache(reset_connector=True)`` the same prompt is a full miss, in every tier, and
what is stored from then on is the new weights' KV. vLLM's own prefix cache is off in the
engine: every cached token is kvwarden's."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvbench.vllm import EngineProcess
from tests.e2e.vllm_support import CHUNK, FULL, PROMPT, VLLM_PYTHON, Reference
from tests.helpers import ServerProcess, wait_until
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("vllm")]  # one worker: the vLLM engines


def _metric(srv: ServerProcess, head: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{srv.http_port}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(head))


def _tiers(srv: ServerProcess, model: str) -> dict[str, int]:
    """Prefix tokens of PROMPT each tier holds for the engine's model (`POST /v1/lookup`)."""
    body = {"requests": [{"model": model, "token_ids": PROMPT}]}
    got = httpx.post(f"http://127.0.0.1:{srv.http_port}/v1/lookup", json=body, timeout=30).json()["results"][
        0
    ]
    return {k: got[k] for k in ("cpu_tokens", "disk_tokens", "external_tokens")}


def test_a_reset_after_a_weight_update_leaves_no_hit_of_the_old_weights(
    reference: Reference, tmp_path: Path, redis_server: RedisServer
) -> None:
    fs = tmp_path / "fs"
    fs.mkdir()
    tiers = ("--fs-path", str(fs), "--fs-size-gb", "0.25", "--remote-url", redis_server.url)
    srv = ServerProcess(tmp_path / "server", "--chunk-size", str(CHUNK), "--l1-size-gb", "0.5", *tiers)
    try:
        srv.wait_ready()
        model = str(reference.models.model)  # (as the engine serves it, and its workers register)
        log = tmp_path / "engine.log"
        engine = EngineProcess(
            VLLM_PYTHON,
            reference.models.model,
            srv.endpoint,
            log,
            {"kvwarden.retry_s": 0.5},
            one_process=True,
        )
        try:
            first = engine.generate(PROMPT, 8)
            assert first["cached"] == 0
            held = {"cpu_tokens": FULL, "disk_tokens": FULL, "external_tokens": FULL}
            wait_until(lambda: _tiers(srv, model) == held, 60, what="the prompt's chunks in every tier")
            assert engine.command({"perturb": 1}) == {"perturbed": 1}  # the weights change
            stale = engine.generate(PROMPT, 8)  # no reset: the old weights' KV is served
            assert stale["cached"] == FULL
            assert engine.command({"reset": True}) == {"reset": True}
            assert _tiers(srv, model) == {"cpu_tokens": 0, "disk_tokens": 0, "external_tokens": 0}
            clears = 'kvwarden_cache_clears_total{origin="engine",outcome="complete"}'
            assert _metric(srv, clears) == 1
            retrieved = _metric(srv, 'kvwarden_transfer_bytes_total{direction="retrieve"}')
            fresh = engine.generate(PROMPT, 8)  # a full miss: computed with the new weights
            assert fresh["cached"] == 0
            assert _metric(srv, 'kvwarden_transfer_bytes_total{direction="retrieve"}') == retrieved
            assert fresh["logprobs"] != first["logprobs"]  # (the weights did change)
            wait_until(lambda: _tiers(srv, model) == held, 60, what="the new weights' chunks in every tier")
            again = engine.generate(PROMPT, 8)  # a hit again, now of the new weights' KV
            assert again["cached"] == FULL and again["tokens"] == fresh["tokens"]
        finally:
            engine.close()
    finally:
        srv.stop()
