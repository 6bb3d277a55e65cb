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

from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest

from kvbench.vllm import EngineProcess
from tests.e2e.vllm_support import (
    FULL,
    SALTED,
    Models,
    Reference,
    engine,
    l1_chunks,
    lora,
    serve,
)
from tests.e2e.vllm_support import LORA_PROMPT as PROMPT
from tests.helpers import ServerProcess, wait_until

pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("vllm")]  # one worker: the vLLM engines


class Pair(NamedTuple):
    srv: ServerProcess
    first: EngineProcess
    second: EngineProcess


@pytest.fixture(scope="module")
def models(reference: Reference) -> Models:
    return reference.models


@pytest.fixture(scope="module")
def expected(reference: Reference) -> dict[str, list[int]]:
    """Each case's greedy output from the session's engine without kvwarden (LoRA on, like the
    others; ``REFERENCE_CASES``: base, a, b, salted, salted:tenant-a, salted:tenant-a:a)."""
    return reference.tokens


@pytest.fixture(scope="module")
def pair(models: Models, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """One server and two engine processes with kvwarden's connector and LoRA on, for the
    module's tests (started one after the other, after the engine without kvwarden has answered:
    one engine at a time builds)."""
    tmp = tmp_path_factory.mktemp("pair")
    srv = serve(tmp / "server")
    engines: list[EngineProcess] = []
    try:
        engines.append(engine(models.model, srv.endpoint, tmp, lora_on=True))
        engines.append(engine(models.model, srv.endpoint, tmp, lora_on=True))
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


def test_lora_adapters_do_not_share_chunks(
    models: Models, expected: dict[str, list[int]], pair: Pair
) -> None:
    miss(pair, pair.first, PROMPT, expected["base"])  # the base model's KV, stored
    # the same tokens with an adapter: the base model's chunks are not theirs
    miss(pair, pair.second, PROMPT, expected["a"], lora=lora(models, "a", 2))
    miss(pair, pair.second, PROMPT, expected["b"], lora=lora(models, "b", 2))
    # each one's own chunks: from this engine's stores, and the other engine's, whatever id each
    # engine gives the adapter
    hit(pair.second, PROMPT, expected["a"], lora=lora(models, "a", 2))
    hit(pair.first, PROMPT, expected["a"], lora=lora(models, "a", 1))
    hit(pair.first, PROMPT, expected["b"], lora=lora(models, "b", 1))
    hit(pair.second, PROMPT, expected["base"])


def test_cache_salts_do_not_share_chunks(models: Models, expected: dict[str, list[int]], pair: Pair) -> None:
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
        lora=lora(models, "a", 2),
    )
    # each tenant its own chunks, from either engine
    hit(pair.second, SALTED, want, cache_salt="tenant-a")
    hit(pair.first, SALTED, want, cache_salt="tenant-b")
    hit(pair.first, SALTED, want)
    hit(pair.first, SALTED, expected["salted:tenant-a:a"], cache_salt="tenant-a", lora=lora(models, "a", 1))
