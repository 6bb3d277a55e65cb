"""Tenants and LoRA adapters stay apart in kvwarden, with real vLLM engine processes (vLLM's CPU
build, from ``.venv-vllm``) and a real ``kvwarden serve``.

A prompt's KV depends on more than its tokens: a LoRA adapter on ``k_proj``/``v_proj`` changes
it, and a ``cache_salt`` says that a tenant's cache must not serve another's. Like vLLM's own
prefix cache, kvwarden must serve a request only chunks stored for the same adapter (its name,
path and weights; not the number an engine gives it, which is the engine's own) and the same
salt. Two engines with kvwarden's connector share one server; vLLM's own prefix caching is off,
so a cached token can only have come from kvwarden. Every answer is compared token for token
with an engine without kvwarden (greedy sampling), and every miss waits for its chunks to land
in the server's L1 before the next request.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

from kvbench.vllm import EngineProcess
from tests.e2e.test_vllm import CHUNK, VLLM_PYTHON, l1_chunks, serve
from tests.helpers import ROOT, ServerProcess, subprocess_env, wait_until

pytestmark = pytest.mark.timeout(900)

ENGINE_LORA = {"max_lora_rank": 8, "max_loras": 2}  # both adapters stay loaded (1: swapped in turn)
rng = np.random.default_rng(23)
PROMPT = [int(x) for x in rng.integers(3, 1000, 1100)]  # 4 full chunks may be loaded (of 1,099)
SALTED = [int(x) for x in rng.integers(3, 1000, 1100)]  # the cache_salt test's own prompt
FULL = 4 * CHUNK  # what a hit of either prompt loads: every full chunk but the last token's
CASES: list[tuple[str, list[int], str | None, str | None]] = [  # name, prompt, salt, adapter
    ("base", PROMPT, None, None),
    ("a", PROMPT, None, "a"),
    ("b", PROMPT, None, "b"),
    ("salted", SALTED, None, None),
    ("salted:tenant-a", SALTED, "tenant-a", None),
    ("salted:tenant-a:a", SALTED, "tenant-a", "a"),
]


class Setup(NamedTuple):
    model: Path
    adapters: dict[str, Path]  # adapter name: its directory


class Pair(NamedTuple):
    srv: ServerProcess
    first: EngineProcess
    second: EngineProcess


def lora(setup: Setup, name: str, engine: int) -> dict[str, Any]:
    """The LoRA request for adapter ``name`` as engine ``engine`` (0: the one without kvwarden, 1 or
    2) numbers it: each engine its own ids, as separate engines do."""
    ids = {"a": (1, 1, 2), "b": (2, 2, 1)}
    return {"name": f"adapter-{name}", "id": ids[name][engine], "path": str(setup.adapters[name])}


def start(setup: Setup, url: str | None, log: Path) -> EngineProcess:
    """An engine with LoRA on; kvwarden's connector (retrying fast) when ``url`` is given. Every
    engine's worker computes on the same number of cores (vLLM keeps one more from an engine with
    a KV connector): another number of threads may sum in another order, and flip a near tie."""
    return EngineProcess(
        VLLM_PYTHON,
        setup.model,
        url,
        log,
        {"kvwarden.retry_s": 0.5},
        env_extra={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"},
        lora=ENGINE_LORA,
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: `make vllm-env` sets up vLLM's environment (make test does)")
    root = tmp_path_factory.mktemp("isolation")
    out = Setup(root / "tiny-llama", {"a": root / "lora-a", "b": root / "lora-b"})
    code = (
        "from kvbench.vllm_model import TINY, build_model, write_lora; "
        f"build_model({str(out.model)!r}, TINY); "
        f"write_lora({str(out.adapters['a'])!r}, TINY, seed=1); "
        f"write_lora({str(out.adapters['b'])!r}, TINY, seed=2)"
    )
    subprocess.run([str(VLLM_PYTHON), "-c", code], check=True, cwd=ROOT, env=subprocess_env(), timeout=300)
    return out


@pytest.fixture(scope="module")
def expected(setup: Setup, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """Each case's greedy output from an engine without kvwarden (LoRA on, like the others)."""
    eng = start(setup, None, tmp_path_factory.mktemp("baseline") / "engine.log")
    try:
        out: dict[str, list[int]] = {}
        for name, prompt, salt, adapter in CASES:
            spec = None if adapter is None else lora(setup, adapter, 0)
            answer = eng.generate(prompt, cache_salt=salt, lora=spec)
            assert answer["cached"] == 0, answer  # nothing to hit: no connector, no prefix caching
            out[name] = answer["tokens"]
        return out
    finally:
        eng.close()


@pytest.fixture(scope="module")
def pair(
    setup: Setup, expected: dict[str, list[int]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    """One server and two engine processes with kvwarden's connector, for the module's tests
    (started after the engine without kvwarden has gone: one engine at a time builds)."""
    tmp = tmp_path_factory.mktemp("pair")
    srv = serve(tmp / "server")
    engines: list[EngineProcess] = []
    try:
        engines.append(start(setup, srv.endpoint, tmp / "engine-1.log"))
        engines.append(start(setup, srv.endpoint, tmp / "engine-2.log"))
        yield Pair(srv, engines[0], engines[1])
    finally:
        for eng in engines:
            eng.kill()
        srv.stop()


def miss(pair: Pair, eng: EngineProcess, prompt: list[int], want: list[int], **kw: Any) -> None:
    """A request nothing stored may serve: it recomputes (the expected output) and stores its
    chunks; returns once all of them are in the server's L1."""
    before = l1_chunks(pair.srv)
    out = eng.generate(prompt, **kw)
    assert out["cached"] == 0, f"{kw}: served chunks stored for another adapter or salt: {out}"
    assert out["tokens"] == want, (kw, out)
    now = wait_until(
        lambda: n if (n := l1_chunks(pair.srv)) >= before + 4 else 0,
        30,
        0.05,
        what=f"the 4 chunks of the request ({kw}) to be stored",
    )
    assert now == before + 4, (kw, before, now)


def hit(eng: EngineProcess, prompt: list[int], want: list[int], **kw: Any) -> None:
    out = eng.generate(prompt, **kw)
    assert out["cached"] == FULL, (kw, out)
    assert out["tokens"] == want, (kw, out)


def test_adapters_change_the_output(expected: dict[str, list[int]]) -> None:
    # the adapters (k_proj and v_proj only) change the prompt's KV, hence the greedy output;
    # a salt changes nothing computed
    assert len({tuple(expected[k]) for k in ("base", "a", "b")}) == 3, expected
    assert expected["salted:tenant-a"] == expected["salted"]
    assert expected["salted:tenant-a:a"] != expected["salted"]


def test_lora_adapters_do_not_share_chunks(setup: Setup, expected: dict[str, list[int]], pair: Pair) -> None:
    miss(pair, pair.first, PROMPT, expected["base"])  # the base model's KV, stored
    # the same tokens with an adapter: the base model's chunks are not theirs
    miss(pair, pair.second, PROMPT, expected["a"], lora=lora(setup, "a", 2))
    miss(pair, pair.second, PROMPT, expected["b"], lora=lora(setup, "b", 2))
    # each one's own chunks: from this engine's stores, and the other engine's, whatever id each
    # engine gives the adapter
    hit(pair.second, PROMPT, expected["a"], lora=lora(setup, "a", 2))
    hit(pair.first, PROMPT, expected["a"], lora=lora(setup, "a", 1))
    hit(pair.first, PROMPT, expected["b"], lora=lora(setup, "b", 1))
    hit(pair.second, PROMPT, expected["base"])


def test_cache_salts_do_not_share_chunks(setup: Setup, expected: dict[str, list[int]], pair: Pair) -> None:
    want = expected["salted"]
    miss(pair, pair.first, SALTED, want, cache_salt="tenant-a")
    # another tenant, and no tenant, on another engine: nothing of tenant-a's
    miss(pair, pair.second, SALTED, want, cache_salt="tenant-b")
    miss(pair, pair.second, SALTED, want)
    # the salt and the adapter together: neither one's chunks alone
    miss(
        pair,
        pair.second,
        SALTED,
        expected["salted:tenant-a:a"],
        cache_salt="tenant-a",
        lora=lora(setup, "a", 2),
    )
    # each tenant its own chunks, from either engine
    hit(pair.second, SALTED, want, cache_salt="tenant-a")
    hit(pair.first, SALTED, want, cache_salt="tenant-b")
    hit(pair.first, SALTED, want)
    hit(pair.first, SALTED, expected["salted:tenant-a:a"], cache_salt="tenant-a", lora=lora(setup, "a", 1))
