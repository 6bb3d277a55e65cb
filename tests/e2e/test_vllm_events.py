"""KV events with a real vLLM CPU engine: kvwarden's events name the engine's own blocks (the
block hashes, parents and tokens of vLLM's own events for the same prompt), and the connector
adds kvwarden's events to the engine's own stream (``take_events``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvbench.vllm import EngineProcess
from tests.e2e.test_kv_events import Decoder, decoder, replay_batches  # noqa: F401  (the fixture)
from tests.e2e.vllm_support import CHUNK, FRESH, PROMPT, VLLM_PYTHON, Reference
from tests.helpers import ServerProcess, free_port, wait_until

pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("vllm")]  # one worker: the vLLM engines


def replay(port: int) -> list[bytes]:
    """Every batch a publisher still holds (vLLM's and kvwarden's replay sockets answer alike)."""
    return [payload for _, payload in replay_batches(port)]


def stored(dec: Decoder, batches: list[bytes]) -> list[dict[str, Any]]:
    return [e for p in batches for e in dec.decode(p)["events"] if e["type"] == "BlockStored"]


def test_kvwarden_events_name_the_engines_blocks_and_join_its_stream(
    reference: Reference,
    tmp_path: Path,
    decoder: Decoder,  # noqa: F811
) -> None:
    pub, pub_replay, eng_pub, eng_replay = (free_port() for _ in range(4))
    srv = ServerProcess(
        tmp_path / "server",
        "--chunk-size",
        str(CHUNK),
        "--l1-size-gb",
        "0.5",
        "--kv-events-endpoint",
        f"tcp://*:{pub}",
        "--kv-events-replay-endpoint",
        f"tcp://*:{pub_replay}",
    )
    eng = None
    try:
        srv.wait_ready()
        own_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{eng_pub}",
            "replay_endpoint": f"tcp://*:{eng_replay}",
        }
        eng = EngineProcess(
            VLLM_PYTHON,
            reference.models.model,
            srv.endpoint,
            tmp_path / "engine.log",
            {"kvwarden.retry_s": 0.5, "kvwarden.kv_events_endpoint": f"tcp://127.0.0.1:{pub}"},
            prefix_caching=True,  # (vLLM publishes its own blocks' events only with it)
            env_extra={"KVWARDEN_ENGINE_KV_EVENTS": json.dumps(own_events)},
            one_process=True,
        )
        out = eng.generate(PROMPT)
        assert out["tokens"] == reference.tokens["prompt"] and out["cached"] == 0
        n_chunks = len(PROMPT) // CHUNK  # the full chunks a miss stores: 4
        wait_until(lambda: len(stored(decoder, replay(pub_replay))) == n_chunks, 30, 0.2, what="the stores")
        ours = stored(decoder, replay(pub_replay))
        assert all(e["medium"] == "CPU" and e["ownership"] == "kvwarden" for e in ours)

        # the engine's own events for the same prompt (its GPU-tier blocks, no ownership)
        theirs = [e for e in stored(decoder, replay(eng_replay)) if e.get("ownership") is None]
        engine_hashes = [h for e in theirs for h in e["block_hashes"]]
        block_size = theirs[0]["block_size"]
        per = CHUNK // block_size
        assert [e["block_size"] for e in ours] == [block_size] * n_chunks
        ours_hashes = [h for e in ours for h in e["block_hashes"]]
        assert len(ours_hashes) == n_chunks * per
        assert ours_hashes == engine_hashes[: n_chunks * per]  # the same names for the same blocks
        assert [e["parent_block_hash"] for e in ours] == [None, *(ours_hashes[per - 1 :: per][:-1])]
        assert [t for e in ours for t in e["token_ids"]] == PROMPT[: n_chunks * CHUNK]
        # a router that has the engine's hashes asks by them
        ask = {"model": str(reference.models.model), "block_hashes": engine_hashes, "block_size": block_size}
        r = httpx.post(f"http://127.0.0.1:{srv.http_port}/v1/lookup", json={"requests": [ask]}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["results"][0]["total_tokens"] == n_chunks * CHUNK

        # kvwarden's events join the engine's own stream on its next steps
        deadline = time.monotonic() + 60
        forwarded: list[dict[str, Any]] = []
        while not forwarded and time.monotonic() < deadline:
            eng.generate(FRESH, max_tokens=2)
            forwarded = [e for e in stored(decoder, replay(eng_replay)) if e.get("ownership") == "kvwarden"]
        assert [h for e in forwarded for h in e["block_hashes"]][: len(ours_hashes)] == ours_hashes
    finally:
        if eng is not None:
            eng.kill()
        srv.stop()
