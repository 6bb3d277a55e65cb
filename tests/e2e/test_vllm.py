"""kvwarden as vLLM's KV connector, with real vLLM engine processes (vLLM's CPU build, from the
``.venv-vllm`` environment that ``make test`` sets up) and a real ``kvwarden serve``.

A tiny random-weight Llama is built here (no download); prompts are token ids and sampling is
greedy, so every engine's output is compared token for token with an engine without kvwarden.
vLLM's own prefix caching is off: a cached token can only have come from kvwarden.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kvbench.vllm import EngineProcess
from tests.helpers import ROOT, ServerProcess, subprocess_env, wait_until

pytestmark = pytest.mark.timeout(900)

VLLM_PYTHON = Path(os.environ.get("KVWARDEN_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
CHUNK = 256  # the server's chunk size: two of vLLM's 128-token CPU blocks
ENGINE_START_S = 240.0
rng = np.random.default_rng(11)
PROMPT = [int(x) for x in rng.integers(3, 1000, 1100)]  # 4 full chunks may be loaded (of 1,099)
SHARES_ONE = PROMPT[:CHUNK] + [int(x) for x in rng.integers(3, 1000, 700)]  # only chunk 0 in common


def Engine(model: Path, url: str | None, workdir: Path, **extra: Any) -> EngineProcess:
    """A vLLM engine process; kvwarden's connector when ``url`` is given (retrying fast)."""
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / f"engine-{time.monotonic_ns()}.log"
    return EngineProcess(VLLM_PYTHON, model, url, log, {"kvwarden.retry_s": 0.5, **extra})


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: `make vllm-env` sets up vLLM's environment (make test does)")
    path = tmp_path_factory.mktemp("vllm") / "tiny-llama"
    code = f"from kvbench.vllm_model import TINY, build_model; build_model({str(path)!r}, TINY)"
    subprocess.run([str(VLLM_PYTHON), "-c", code], check=True, cwd=ROOT, env=subprocess_env(), timeout=300)
    return path


@pytest.fixture(scope="module")
def expected(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """Each prompt's greedy output from an engine without kvwarden."""
    eng = Engine(model, None, tmp_path_factory.mktemp("baseline"))
    try:
        return {
            name: eng.generate(p)["tokens"] for name, p in (("prompt", PROMPT), ("shares_one", SHARES_ONE))
        }
    finally:
        eng.close()


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[list[EngineProcess]]:
    started: list[EngineProcess] = []
    yield started
    for eng in started:
        eng.kill()


def instances(srv: ServerProcess) -> list[dict[str, Any]]:
    r = httpx.get(f"http://127.0.0.1:{srv.http_port}/status", timeout=10)
    out: list[dict[str, Any]] = r.json()["instances"]
    return out


def l1_chunks(srv: ServerProcess) -> int:
    r = httpx.get(f"http://127.0.0.1:{srv.http_port}/status", timeout=10)
    return int(r.json()["storage"]["l1"]["chunks"])


def serve(tmp: Path, port: int = 0, http_port: int = 0) -> ServerProcess:
    srv = ServerProcess(
        tmp, "--chunk-size", str(CHUNK), "--l1-size-gb", "0.5", "--worker-disconnect-grace-seconds", "2",
        port=port, http_port=http_port,
    )  # fmt: skip
    srv.wait_ready()
    return srv


def test_engines_share_prompt_chunks_and_survive_the_server(
    model: Path, expected: dict[str, list[int]], engines: list[EngineProcess], tmp_path: Path
) -> None:
    # an engine that starts before its server: correct output (recompute), then it registers
    srv = ServerProcess(tmp_path / "s0", "--chunk-size", str(CHUNK))  # only for its free ports
    srv.stop()
    first = Engine(model, srv.endpoint, tmp_path, **{"kvwarden.connect_wait_s": 0.5})
    engines.append(first)
    out = first.generate(PROMPT)
    assert out["tokens"] == expected["prompt"] and out["cached"] == 0
    srv = serve(tmp_path / "s1", srv.port, srv.http_port)
    try:
        wait_until(
            lambda: len(instances(srv)) == 1,
            30,
            0.2,
            what="the engine's worker to register once the server is up",
        )
        (inst,) = instances(srv)
        assert inst["model_name"] == str(model) and inst["transfer_mode"] == "engine_driven"
        out = first.generate(PROMPT)  # a miss: stores the prompt's full chunks
        assert out["tokens"] == expected["prompt"] and out["cached"] == 0
        first.close()  # its stores are over before it unregisters
        wait_until(lambda: not instances(srv), 30, 0.2, what="the first engine to unregister")
        assert l1_chunks(srv) == 4

        # a second engine process hits every stored chunk; same output
        second = Engine(model, srv.endpoint, tmp_path, **{"kvwarden.heartbeat_interval_s": 0.5})
        engines.append(second)
        out = second.generate(PROMPT)
        assert out["cached"] == 4 * CHUNK, out  # every full chunk but the one holding the last token
        assert out["tokens"] == expected["prompt"]
        out = second.generate(SHARES_ONE)
        assert out["cached"] == CHUNK, out  # exactly the one chunk it shares
        assert out["tokens"] == expected["shares_one"]

        # the server SIGKILLed: outputs stay correct (recompute)
        srv.proc.kill()
        srv.proc.wait(10)
        out = second.generate(PROMPT)
        assert out["tokens"] == expected["prompt"] and out["cached"] == 0
        # restarted where it was: the engine registers again, stores, and hits; so does the next engine
        srv = serve(tmp_path / "s2", srv.port, srv.http_port)
        wait_until(
            lambda: len(instances(srv)) == 1, 30, 0.2, what="the engine to register with the restarted server"
        )
        (kept,) = [i["instance_id"] for i in instances(srv)]
        assert second.generate(PROMPT)["cached"] == 0  # L1 restarted empty: this stores
        wait_until(lambda: l1_chunks(srv) == 4, 30, 0.1, what="the store (off the step) to land")
        out = second.generate(PROMPT)
        assert out["cached"] == 4 * CHUNK and out["tokens"] == expected["prompt"], out
        third = Engine(model, srv.endpoint, tmp_path)
        engines.append(third)
        out = third.generate(PROMPT)
        assert out["cached"] == 4 * CHUNK and out["tokens"] == expected["prompt"], out
        assert len(instances(srv)) == 2  # both engines' workers, while they run

        # an engine SIGKILLed: its worker is reaped within the disconnect grace, the other stays
        third.kill()
        t0 = time.monotonic()
        wait_until(
            lambda: [i["instance_id"] for i in instances(srv)] == [kept], 30, 0.2,
            what="the killed engine's worker to be reaped",
        )  # fmt: skip
        assert time.monotonic() - t0 < 2 + 5  # grace 2 s, reaper cadence and the poll
        assert "reaped" in srv.output()
        second.close()
        wait_until(lambda: not instances(srv), 30, 0.2, what="the second engine to unregister")
    finally:
        srv.stop()
