"""A prefix just stored is a hit for the next request, with real vLLM engines (vLLM's CPU build).

The model is built here (no download) with 32 KiB of KV a token (8 layers, 8 KV heads, head dim
128: `kvbench.vllm_model.PREFILL`), the prompts are 2,900 tokens, one output token each, vLLM's
own prefix caching off on kvwarden's engines: the repeat of a request sent the moment the first
answered would race the connector's store of it, and must hit (2,816 tokens: every full chunk but
the last token's); on the same engine it is copied from the first one's blocks, which vLLM holds
until that store is over. Outputs are compared token for token with an engine that has vLLM's own
prefix caching on and serves each prompt twice: its first pass is the miss (a full prefill), its
second the prefix-cache hit on the same 2,816 tokens.

A store is caught in flight by polling the server's LOOKUP_SCOPE as the engine's scheduler asks
it, and frozen there by SIGSTOP of the storing engine's process group: another engine's request
then waits for it (the server's ``kvwarden_lookup_pending_tokens_total`` grows with its re-asks),
and hits once the store goes on (SIGCONT), or falls back to a miss as soon as the server sees
the storing engine's connections close when it is SIGKILLed instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import NamedTuple

import httpx
import numpy as np
import pytest

from dataplane.client.vllm.lookup import Scope, ScopeLookup
from kvbench.vllm import EngineProcess
from tests.e2e.vllm_support import CHUNK, VLLM_PYTHON, cpu_format, require_vllm, serve
from tests.helpers import ServerProcess, subprocess_env, wait_until

pytestmark = [pytest.mark.timeout(1800), pytest.mark.xdist_group("vllm")]  # one worker: the vLLM engines

TOKENS, HIT = 2900, 2816  # the hit: 11 chunks of 256 = 22 of vLLM's 128-token blocks
# the bound on one request that prefills all 2,900 tokens: ~35 s on a core of this host alone,
# over 120 s on a slow day with the rest of the suite beside it (a bound, never a wait)
PREFILL_S = 600.0
_rng = np.random.default_rng(31)
PROMPTS = [[int(x) for x in _rng.integers(3, 1000, TOKENS)] for _ in range(10)]
REPEATED, KILLED = PROMPTS[:3], PROMPTS[4:8]  # KILLED: tries of the kill test
SHARED = (3, 8, 9)  # tries of the shared-store test (indices in PROMPTS): a store may slip past


class Ref(NamedTuple):
    miss: list[int]  # a full prefill's output
    hit: list[int]  # vLLM's own prefix-cache hit on the same tokens


class References:
    """The reference outputs of PROMPTS, each computed when a test first asks for it, by an
    engine with vLLM's own prefix caching on (its first pass the miss, its second the hit): a
    prefill of 2,900 tokens took ~35 s on a core without AVX-512 (the 20 of all ten prompts, up
    front, 13 minutes), and a test asks for a prompt's only when it got that far. Between uses
    the engine is stopped (SIGSTOP of its process group), so that it takes nothing from engine
    a, which shares its core; ask only while engines a and b are idle."""

    def __init__(self, engine: EngineProcess) -> None:
        self.engine = engine
        self._done: dict[int, Ref] = {}
        os.killpg(engine.proc.pid, signal.SIGSTOP)

    def __getitem__(self, i: int) -> Ref:
        if i not in self._done:
            os.killpg(self.engine.proc.pid, signal.SIGCONT)
            try:
                miss = self.engine.generate(PROMPTS[i], 1, PREFILL_S)
                hit = self.engine.generate(PROMPTS[i], 1, PREFILL_S)
            finally:
                os.killpg(self.engine.proc.pid, signal.SIGSTOP)
            assert (miss["cached"], hit["cached"]) == (0, HIT)
            self._done[i] = Ref(miss["tokens"], hit["tokens"])
        return self._done[i]


class World(NamedTuple):
    model: Path
    ref: References  # per prompt of PROMPTS
    srv: ServerProcess
    a: EngineProcess
    b: EngineProcess


def _metric(srv: ServerProcess, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{srv.http_port}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def _engine(
    model: Path, url: str | None, log: Path, core: int, prefix_caching: bool = False, wait_s: float = 1.0
) -> EngineProcess:
    """An engine whose worker computes on one thread bound to ``core``: every engine computes
    alike (one thread), and two engines at once do not share a core (a waiting engine's vLLM
    worker spins on its core, which would starve another worker's store, and teardown, there)."""
    extra = {"kvwarden.retry_s": 0.5, "kvwarden.lookup_wait_s": wait_s}
    env = {"VLLM_CPU_OMP_THREADS_BIND": str(core)}
    return EngineProcess(VLLM_PYTHON, model, url, log, extra, prefix_caching, env_extra=env, one_process=True)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    require_vllm()
    tmp = tmp_path_factory.mktemp("ryw")
    model = tmp / "model"
    code = f"from kvbench.vllm_model import PREFILL, build_model; build_model({str(model)!r}, PREFILL)"
    subprocess.run([str(VLLM_PYTHON), "-c", code], check=True, env=subprocess_env())
    engines = [_engine(model, None, tmp / "reference.log", 0, prefix_caching=True)]
    try:
        srv = serve(tmp / "server")
    except BaseException:
        engines[0].kill()
        raise
    try:
        ref = References(engines[0])
        with ThreadPoolExecutor(2) as pool:  # the two engines start side by side
            starts = [
                pool.submit(_engine, model, srv.endpoint, tmp / "engine-a.log", 0),
                # b waits up to 60 s: the kill test must see it released by the store's end
                pool.submit(_engine, model, srv.endpoint, tmp / "engine-b.log", 1, False, 60.0),
            ]
        engines += [f.result() for f in starts if f.exception() is None]
        for f in starts:
            f.result()  # raises a start's failure (the one that started is killed below)
        yield World(model, ref, srv, *engines[1:])
    finally:
        for eng in engines:
            eng.kill()  # (SIGKILL: the stopped reference engine too)
        srv.stop()


def _lookup(w: World) -> ScopeLookup:
    """LOOKUP_SCOPE as the engines' schedulers ask it."""
    scope = Scope(str(w.model), 1, "bfloat16", 8, 8, 128, cpu_format(), 128)
    # asked every time (no rest after a failure): a probe that rested after a hiccup of its
    # connection would sleep through the store it is there to catch
    return ScopeLookup(w.srv.endpoint, scope, timeout_s=5.0, retry_s=0.0)


def _freeze_mid_store(w: World, prompt: list[int], look: ScopeLookup) -> tuple[int, int]:
    """Send ``prompt`` to engine a and SIGSTOP it while its store is in flight; (hit, pending)
    tokens then (pending 0: the store was over before the stop landed)."""
    tokens = np.asarray(prompt[:-1], dtype=np.int64)
    w.a.submit(prompt, 1)
    deadline = time.monotonic() + PREFILL_S
    while time.monotonic() < deadline:
        if w.a.proc.poll() is not None:
            raise AssertionError(f"engine a exited ({w.a.proc.returncode}) before it stored\n" + w.a.tail())
        found = look.find(tokens)
        if found.pending or found.hit:
            os.killpg(w.a.proc.pid, signal.SIGSTOP)
            after = look.find(tokens)
            return after.hit, after.pending
    raise AssertionError("engine a never stored its prompt\n" + w.a.tail())


def _waiting(w: World, since: float) -> bool:
    """Engine b asked again while chunks were pending: it is waiting."""
    return _metric(w.srv, "kvwarden_lookup_pending_tokens_total") >= since + 2 * CHUNK


def test_a_repeat_sent_the_moment_the_first_answered_hits_every_time(world: World) -> None:
    w = world
    for i, p in enumerate(REPEATED):
        ref = w.ref[i]  # (before engine a works: they share a core)
        waits = _metric(w.srv, "kvwarden_lookup_waits_total")
        first = w.a.generate(p, 1, PREFILL_S)
        # nothing was in flight for its prefix: it was never held back (no wait was reported)
        assert _metric(w.srv, "kvwarden_lookup_waits_total") == waits
        assert first["cached"] == 0 and first["tokens"] == ref.miss
        again = w.a.generate(p, 1, PREFILL_S)  # the first one's store is still running
        assert again["cached"] >= HIT, (again, w.a.tail())
        assert again["tokens"] == ref.hit
        # copied from the first one's blocks, still held for its store: it never waited either
        assert _metric(w.srv, "kvwarden_lookup_waits_total") == waits
    assert _metric(w.srv, 'kvwarden_lookup_waits_total{outcome="gave_up"}') == 0


def test_another_engine_asking_while_the_first_stores_waits_and_hits(world: World) -> None:
    w = world
    look = _lookup(w)
    try:
        for at in SHARED:
            hit, pending = _freeze_mid_store(w, PROMPTS[at], look)
            if pending > 0:
                break
            os.killpg(w.a.proc.pid, signal.SIGCONT)  # the store was over before the stop: the next
            w.a.result(PREFILL_S)
        else:
            pytest.fail(f"no store of engine a was caught in flight in {len(SHARED)} tries")
        prompt = PROMPTS[at]
        try:
            seen = _metric(w.srv, "kvwarden_lookup_pending_tokens_total")
            w.b.submit(prompt, 1)
            wait_until(lambda: _waiting(w, seen), 60, 0.05, what="engine b waiting for the store")
        finally:
            os.killpg(w.a.proc.pid, signal.SIGCONT)
        first = w.a.result(PREFILL_S)
        got = w.b.result(PREFILL_S)
    finally:
        look.close()
    ref = w.ref[at]  # (engines a and b are idle again)
    assert first["tokens"] == ref.miss
    assert got["cached"] >= HIT and got["tokens"] == ref.hit, (hit, pending, got)
    assert _metric(w.srv, 'kvwarden_lookup_waits_total{outcome="hit"}') >= 1


def test_a_store_whose_engine_is_killed_releases_the_waiter_at_once_with_a_miss(world: World) -> None:
    """Last: it kills engine a. The waiter is released once the server sees the dead engine's
    connections close, which is when the kernel has torn the process down (nothing observes a
    death sooner): the release is timed from the close."""
    w = world
    look = _lookup(w)
    try:
        for i, p in enumerate(KILLED):
            tokens = np.asarray(p[:-1], dtype=np.int64)
            hit, pending = _freeze_mid_store(w, p, look)
            if hit == 0 and pending > 0:
                seen = _metric(w.srv, "kvwarden_lookup_pending_tokens_total")
                ended = _metric(w.srv, 'kvwarden_lookup_waits_total{outcome="partial"}')
                w.b.submit(p, 1)
                wait_until(partial(_waiting, w, seen), 60, 0.05, what="engine b waiting for the store")
                if look.find(tokens).hit == 0:  # (a commit sent just before the stop lands late)
                    at = 4 + i  # (its index in PROMPTS)
                    break
            os.killpg(w.a.proc.pid, signal.SIGCONT)  # caught too late: the next prompt
            w.a.result(PREFILL_S)
            if hit == 0 and pending > 0:
                w.b.result(PREFILL_S)
        else:
            pytest.fail(f"no store of engine a was caught before its first commit in {len(KILLED)} tries")
        t0 = time.monotonic()
        w.a.kill()  # SIGKILL, while stopped mid-store
        wait_until(lambda: look.find(tokens).pending == 0, 60, 0.02, what="the server to drop the store")
        closed = time.monotonic()
    finally:
        look.close()
    wait_until(  # (a scrape costs the server a few ms: not too often on two cores)
        lambda: _metric(w.srv, 'kvwarden_lookup_waits_total{outcome="partial"}') > ended,
        30,
        0.02,
        what="engine b's wait to end",
    )
    released = time.monotonic() - closed  # (within one scrape interval)
    got = w.b.result(PREFILL_S)
    ref = w.ref[at]  # (engine a is gone, b idle)
    # the kernel closes a killed process's sockets once it has torn it down: 0.2 s on this host
    # alone, over 1 s while the rest of the suite runs beside it; the server and the waiting
    # scheduler then take milliseconds
    assert released < 1.0, f"released {released:.3f}s after the close, seen {closed - t0:.3f}s after the kill"
    assert got["cached"] == 0 and got["tokens"] == ref.miss
    assert _metric(w.srv, 'kvwarden_lookup_waits_total{outcome="gave_up"}') == 0
