"""A disaggregated prefill's handoff (`dataplane.client.vllm.handoff`): what a producer's params
name, what a consumer counts on from them (only for its own key context, never malformed ones),
and the consumer's planner waiting, within its bound, for the named chunks the server does not
hold yet. A fake clock; the lookups are functions."""

from __future__ import annotations

import numpy as np

from dataplane.client.vllm.handoff import expected, key_digest, produced
from dataplane.client.vllm.state import Planner
from dataplane.client.vllm.wait import REASK_S, LookupFound, OwnSaves, Waits
from dataplane.wire.context import KeyContext
from tests.helpers import FakeClock

CS, BS = 16, 4
PROMPT = list(range(4 * CS + 3))
SALTED = KeyContext(b"tenant-a")


def test_a_consumer_counts_on_a_producers_params_for_its_own_key_context_alone() -> None:
    params = produced(4 * CS, SALTED, "tcp://127.0.0.1:1")
    assert params["kvwarden"]["tokens"] == 4 * CS and b"tenant-a".hex() not in str(params)  # no salt
    assert expected(params, SALTED) == 4 * CS
    assert expected(params, None) == 0  # another key context: the params say nothing of it
    assert expected(params, KeyContext(b"tenant-b")) == 0
    assert expected(produced(CS, None, "x"), None) == CS
    for bad in (None, [], {"kvwarden": 3}, {"kvwarden": {"tokens": "64", "key": key_digest(None)}},
                {"kvwarden": {"tokens": -1, "key": key_digest(None)}}, {"other": {}}):  # fmt: skip
        assert expected(bad, None) == 0
    assert key_digest(KeyContext(b"a", b"b")) != key_digest(KeyContext(b"ab", b""))


def test_a_consumer_waits_within_its_bound_for_the_chunks_a_producer_named() -> None:
    held = [0]
    clock = FakeClock()

    def lookup(tokens: np.ndarray, key: KeyContext | None) -> LookupFound:
        return LookupFound(held[0])  # the server sees nothing on its way: the params say it

    reports: list[tuple[float, str]] = []
    p = Planner(
        lookup, BS, Waits(1.0, lambda s, o: reports.append((round(s, 3), o)), clock), OwnSaves(1, clock)
    )
    p.chunk_size = lambda: CS
    assert p.matched("a", PROMPT, 0, None, expected=4 * CS) is None  # named, not there yet: wait
    clock.advance(REASK_S)
    held[0] = 4 * CS  # the producer's store landed
    assert p.matched("a", PROMPT, 0, None, expected=4 * CS) == 4 * CS
    assert reports == [(REASK_S, "hit")]
    # past the bound, the request goes on with what is held
    assert p.matched("b", list(range(100, 100 + 4 * CS + 3)), 0, None, expected=4 * CS) == 4 * CS  # (held)
    held[0] = CS
    assert p.matched("c", PROMPT, 0, None, expected=4 * CS) is None
    clock.advance(1.5)
    assert p.matched("c", PROMPT, 0, None, expected=4 * CS) == CS
    # without params, nothing is waited for
    assert p.matched("d", PROMPT, 0, None) == CS
