"""The scheduler's read-your-writes (`dataplane.client.vllm_wait` through `Planner`): a request
whose prefix is being stored waits for it, within its bound, and is never delayed when nothing
is on its way. A fake clock; the lookups are functions."""

from __future__ import annotations

import numpy as np
import pytest

from dataplane.client.vllm_state import Planner
from dataplane.client.vllm_wait import REASK_S, Found, OwnSaves, Waits
from dataplane.wire.messages import KeyContext
from tests.helpers import FakeClock

CS, BS = 16, 4
PROMPT = list(range(3 * CS + 5))  # three full chunks, and the last token is never loaded


class Server:
    """What lookups answer: ``held`` and ``pending`` tokens; counts the asks."""

    def __init__(self, held: int = 0, pending: int = 0, answered: bool = True) -> None:
        self.held, self.pending, self.answered = held, pending, answered
        self.asked = 0

    def __call__(self, tokens: np.ndarray, key: KeyContext | None) -> Found:
        self.asked += 1
        held = min(self.held, len(tokens) // CS * CS)
        return Found(held, min(self.pending, len(tokens) // CS * CS - held), self.answered)


def planner(server: Server, bound_s: float = 1.0) -> tuple[Planner, FakeClock, list[tuple[float, str]]]:
    clock, reports = FakeClock(), []
    waits = Waits(bound_s, lambda s, o: reports.append((round(s, 6), o)), clock)
    p = Planner(server, BS, waits, OwnSaves(1, clock))
    p.chunk_size = lambda: CS
    return p, clock, reports


def test_nothing_in_flight_is_never_delayed() -> None:
    server = Server(held=CS)
    p, _, reports = planner(server)
    assert p.matched("a", PROMPT, 0) == CS and server.asked == 1 and reports == []
    assert len(p.waits) == 0


def test_a_request_waits_for_chunks_being_stored_and_loads_them_once_they_land() -> None:
    server = Server(held=CS, pending=2 * CS)
    p, clock, reports = planner(server)
    assert p.matched("a", PROMPT, 0) is None  # not decided yet: vLLM asks again next step
    assert p.matched("a", PROMPT, 0) is None and server.asked == 1  # too soon to ask again
    clock.advance(REASK_S)
    server.held, server.pending = 2 * CS, CS  # the first of them landed
    assert p.matched("a", PROMPT, 0) is None and server.asked == 2
    clock.advance(0.05)
    server.held, server.pending = 3 * CS, 0
    assert p.matched("a", PROMPT, 0) == 3 * CS
    assert reports == [(0.052, "hit")]
    assert p.matched("a", PROMPT, 0) == 3 * CS and server.asked == 3  # decided once


def test_a_store_that_fails_ends_the_wait_with_what_is_held() -> None:
    server = Server(pending=3 * CS)
    p, clock, reports = planner(server)
    assert p.matched("a", PROMPT, 0) is None
    clock.advance(0.01)
    server.held, server.pending = CS, 0  # its worker died after one chunk: nothing more comes
    assert p.matched("a", PROMPT, 0) == CS and reports == [(0.01, "partial")]


def test_past_the_bound_the_request_goes_on_with_what_is_held() -> None:
    server = Server(pending=3 * CS)
    p, clock, reports = planner(server, bound_s=0.5)
    assert p.matched("a", PROMPT, 0) is None
    clock.advance(0.499)
    assert p.matched("a", PROMPT, 0) is None
    clock.advance(0.002)
    assert p.matched("a", PROMPT, 0) == 0 and reports == [(0.501, "gave_up")]


def test_a_bound_of_zero_never_waits_and_an_outage_is_not_waited_on() -> None:
    p, _, reports = planner(Server(CS, 2 * CS), bound_s=0.0)
    assert p.matched("a", PROMPT, 0) == CS and reports == []
    p, _, reports = planner(Server(0, 3 * CS, answered=False))
    assert p.matched("a", PROMPT, 0) == 0 and reports == []


def test_the_engines_own_planned_save_is_waited_for_before_the_server_hears_of_it() -> None:
    server = Server()  # the worker has not even sent its store yet
    p, clock, reports = planner(server)
    assert p.matched("first", PROMPT, 0) == 0
    plan = p.plan([("first", PROMPT, list(range(13)), 0, len(PROMPT))], [], False)
    (save,) = plan.saves
    assert save.seq and len(save.tokens) == 3 * CS
    assert p.finished("first") is True  # max_tokens=1: done, its save still running
    again = [*PROMPT[:-2], 7, 7]  # the same prefix, another tail
    assert p.matched("repeat", again, 0) is None
    clock.advance(0.02)
    server.held = 3 * CS
    p.own.done([save.seq])  # the worker's report: the save is over
    assert p.matched("repeat", again, 0) == 3 * CS and reports == [(0.02, "hit")]
    server.held = 0
    other = list(range(1000, 1000 + 3 * CS + 1))  # another prefix is never waited for
    assert p.matched("other", other, 0) == 0 and len(reports) == 1


def test_own_saves_count_per_key_context_and_rank_and_finished_waits_report_nothing() -> None:
    clock = FakeClock()
    own = OwnSaves(ranks=2, clock=clock)
    tokens = np.arange(3 * CS)
    seq = own.add(tokens, KeyContext(b"tenant"))
    assert own.reach(tokens, None) == 0  # another tenant's store is no one else's
    assert own.reach(np.arange(2 * CS), KeyContext(b"tenant")) == 2 * CS
    diverge = np.concatenate([np.arange(CS + 3), [-1] * CS])
    assert own.reach(diverge, KeyContext(b"tenant")) == CS + 3
    own.done([seq])  # one rank of two
    assert own.reach(tokens, KeyContext(b"tenant")) == 3 * CS
    own.done([seq])
    assert own.reach(tokens, KeyContext(b"tenant")) == 0 and len(own) == 0
    own.add(tokens, None)
    clock.advance(1000.0)  # never reported: its worker is gone
    assert own.reach(tokens, None) == 0
    server = Server(pending=3 * CS)
    p, _, reports = planner(server)
    assert p.matched("a", PROMPT, 0) is None
    assert p.finished("a") is False and len(p.waits) == 0 and reports == []  # aborted while waiting


def test_an_engine_with_only_waiting_requests_sleeps_until_the_next_ask() -> None:
    p, clock, _ = planner(Server(pending=3 * CS))
    assert p.waits.idle_s() == 0.0  # nothing waits: never sleeps
    assert p.matched("a", PROMPT, 0) is None
    assert p.waits.idle_s() == pytest.approx(REASK_S)
    clock.advance(REASK_S / 2)
    assert p.waits.idle_s() == pytest.approx(REASK_S / 2)
    clock.advance(REASK_S)
    assert p.waits.idle_s() == 0.0
