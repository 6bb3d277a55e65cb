"""vLLM's ``kv_role`` with real vLLM engine processes (vLLM's CPU build) and a real
``kvwarden serve``: a ``kv_producer`` (the prefill engine of a disaggregated pair) stores and
never loads, a ``kv_consumer`` (the decode engine) loads and never stores, and a consumer hits
what a producer stored. vLLM's own prefix cache is off in these engines: every cached token
is kvwarden's."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvbench.vllm import EngineProcess
from tests.e2e.vllm_support import FULL, PROMPT, SHARES_ONE, VLLM_PYTHON, Reference, l1_chunks, serve
from tests.helpers import ServerProcess, wait_until

pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("vllm")]  # one worker: the vLLM engines


def _bytes(srv: ServerProcess, direction: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{srv.http_port}/metrics", timeout=10).text
    head = f'kvwarden_transfer_bytes_total{{direction="{direction}"}}'
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(head))


def _engine(ref: Reference, srv: ServerProcess, tmp: Path, role: str) -> EngineProcess:
    tmp.mkdir(parents=True, exist_ok=True)
    log = tmp / f"{role}-{len(list(tmp.iterdir()))}.log"
    extra = {"kvwarden.retry_s": 0.5}
    return EngineProcess(
        VLLM_PYTHON, ref.models.model, srv.endpoint, log, extra, env_extra={"KVWARDEN_ENGINE_ROLE": role}
    )


def test_a_producer_only_stores_and_a_consumer_only_loads_what_it_stored(
    reference: Reference, tmp_path: Path
) -> None:
    srv = serve(tmp_path / "server")
    try:
        producer = _engine(reference, srv, tmp_path / "logs", "kv_producer")
        try:
            first = producer.generate(PROMPT, 8)
            assert first["cached"] == 0
            wait_until(lambda: _bytes(srv, "store") > 0, 60, what="the producer's stores")  # (off the step)
            wait_until(lambda: l1_chunks(srv) == 4, 60, what="every full chunk of the prompt")
            stored = _bytes(srv, "store")
            again = producer.generate(PROMPT, 8)  # held by the server, but a producer never loads
            assert again["cached"] == 0 and _bytes(srv, "retrieve") == 0
            assert again["tokens"] == first["tokens"]
        finally:
            producer.close()
        consumer = _engine(reference, srv, tmp_path / "logs", "kv_consumer")
        try:
            hit = consumer.generate(PROMPT, 8)
            assert hit["cached"] == FULL and _bytes(srv, "retrieve") > 0  # the producer's chunks
            other = consumer.generate(SHARES_ONE, 8)  # a chunk in common, the rest computed
            assert other["cached"] == 256
        finally:
            consumer.close()
        assert _bytes(srv, "store") == stored  # the consumer stored nothing of either prompt
    finally:
        srv.stop()
