"""What the connector counts for vLLM's connector stats (`tally.Tally`) and where it says a hit's
tokens come from (`Planner.hit_sources`), through the planner with functions for lookups."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dataplane.client.vllm.state import Planner
from dataplane.client.vllm.tally import Tally
from dataplane.client.vllm.wait import LookupFound, OwnSaves, Waits
from dataplane.wire.messages import KeyContext

CS, BS = 16, 4
PROMPT = list(range(4 * CS + 3))  # four full chunks


def planner(found: LookupFound) -> Planner:
    def lookup(tokens: np.ndarray, key: KeyContext | None) -> LookupFound:
        return found

    p = Planner(lookup, BS, Waits(0.0, lambda s, o: None), OwnSaves(1))
    p.chunk_size = lambda: CS
    return p


def test_a_tally_counts_what_it_is_told_and_starts_afresh_once_taken() -> None:
    t = Tally()
    assert t.take() is None
    t.add(loads_full=1, loaded_tokens=64, loaded_bytes=4096)
    t.add(loaded_tokens=16, stored_chunks=0)  # (a zero is not kept)
    t.load_took(0.25)
    assert t.take() == {
        "counts": {"loads_full": 1, "loaded_tokens": 80, "loaded_bytes": 4096},
        "load_s": [0.25],
    }
    assert t.take() is None
    with pytest.raises(ValueError, match="unknown counter 'hits'"):
        t.add(hits=1)


def test_a_tally_added_to_from_many_threads_loses_nothing() -> None:
    t = Tally()

    def add() -> None:
        for _ in range(1000):
            t.add(stored_chunks=1)

    threads = [threading.Thread(target=add) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    got = t.take()
    assert got is not None and got["counts"] == {"stored_chunks": 4000}


def test_each_request_s_lookup_is_counted_once_by_outcome() -> None:
    hit = planner(LookupFound(2 * CS, l1=CS))
    assert hit.matched("a", PROMPT, 0) == 2 * CS
    assert hit.matched("a", PROMPT, 0) == 2 * CS  # (decided once: counted once)
    miss = planner(LookupFound(0))
    assert miss.matched("b", PROMPT, 0) == 0
    down = planner(LookupFound(0, answered=False))
    assert down.matched("c", PROMPT, 0) == 0
    got = [p.tally.take() for p in (hit, miss, down)]
    assert [g["counts"] if g else None for g in got] == [
        {"lookups_hit": 1},
        {"lookups_miss": 1},
        {"lookups_unanswered": 1},
    ]


def test_a_hit_s_tokens_are_split_by_the_tier_the_server_held_them_in() -> None:
    p = planner(LookupFound(4 * CS, l1=CS, fs=2 * CS))  # L1, then the file tier, then Redis
    assert p.matched("a", PROMPT, 0) == 4 * CS
    assert p.hit_sources("a", 0, 4 * CS) == {"host": CS, "disk": 2 * CS, "remote": CS}
    # vLLM's own cache computed the first 24 tokens (past L1's 16): the rest of the hit is split
    assert p.hit_sources("a", 24, 4 * CS - 24) == {"disk": 3 * CS - 24, "remote": CS}
    assert p.hit_sources("a", 2 * CS, 2 * CS) == {"disk": CS, "remote": CS}
    assert p.hit_sources("a", 0, 0) == {}
    only_l1 = planner(LookupFound(3 * CS, l1=3 * CS))
    only_l1.matched("b", PROMPT, 0)
    assert only_l1.hit_sources("b", 0, 3 * CS) == {"host": 3 * CS}
    p.finished("a")
    assert p.hit_sources("a", 0, CS) == {"remote": CS}  # (forgotten: nothing known of it)
