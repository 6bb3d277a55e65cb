"""The scheduler's read-your-writes (`dataplane.client.vllm.wait` through `Planner`): a request
whose prefix is being stored waits for it, within its bound, and is never delayed when nothing
is on its way. A fake clock; the lookups are functions."""

from __future__ import annotations

import numpy as np
import pytest

from dataplane.client.vllm.state import Planner, Save
from dataplane.client.vllm.wait import REASK_S, LookupFound, OwnSaves, Waits
from dataplane.wire.messages import KeyContext
from tests.helpers import FakeClock

CS, BS = 16, 4
PROMPT = list(range(3 * CS + 5))  # three full chunks, and the last token is never loaded


class Server:
    """What lookups answer: ``held`` and ``pending`` tokens; counts the asks."""

    def __init__(self, held: int = 0, pending: int = 0, answered: bool = True) -> None:
        self.held, self.pending, self.answered = held, pending, answered
        self.asked = 0

    def __call__(self, tokens: np.ndarray, key: KeyContext | None) -> LookupFound:
        self.asked += 1
        held = min(self.held, len(tokens) // CS * CS)
        return LookupFound(held, min(self.pending, len(tokens) // CS * CS - held), self.answered)


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


def test_no_wait_for_chunks_the_engines_own_cache_already_holds() -> None:
    """A prefix being stored that vLLM's own cache already computed is no reason to wait (many
    users with one system prompt: each new user's first chunks are being stored by the last
    one's, and vLLM holds them already); one that reaches past it is waited for."""
    server = Server(held=0, pending=2 * CS)
    p, _, reports = planner(server)
    assert p.matched("a", PROMPT, 2 * CS) == 0 and len(p.waits) == 0 and reports == []
    assert p.matched("b", PROMPT, CS) is None  # the second chunk is worth waiting for
    assert len(p.waits) == 1


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


def _first_saved(p: Planner) -> Save:
    """Request "first" computed and finished (max_tokens=1), its save planned and not over."""
    assert p.matched("first", PROMPT, 0) == 0
    plan = p.plan([("first", PROMPT, [list(range(13))], 0, len(PROMPT))], [], False)
    (save,) = plan.saves
    assert save.seq and len(save.tokens) == 3 * CS
    assert p.finished("first") is True  # its blocks are held until the worker's word
    return save


def test_the_engines_own_save_in_flight_is_copied_from_its_blocks_at_once() -> None:
    server = Server()  # the worker has not even sent its store yet
    p, _, reports = planner(server)
    save = _first_saved(p)
    asked = server.asked
    again = [*PROMPT[:-2], 7, 7]  # the same prefix, another tail
    assert p.matched("repeat", again, 0) == 3 * CS and reports == []  # never held back
    assert server.asked == asked  # it covers all that could load: the server is not asked
    p.allocated("repeat", again, 3 * CS)
    (job,) = p.plan([("repeat", again, [list(range(20, 33))], 0, 5)], [], False).loads
    assert list(job.tokens) == PROMPT[: 3 * CS]
    assert job.source is not None and list(job.source) == list(save.blocks[:12])  # 3 chunks, 12 blocks
    other = list(range(1000, 1000 + 3 * CS + 1))  # another prefix: the server's answer
    assert p.matched("other", other, 0) == 0 and p.own.source(np.asarray(other), None) is None
    salted = p.own.source(np.asarray(PROMPT), KeyContext(b"tenant"))
    assert salted is None  # another key context's KV is not the same KV


def test_a_save_over_or_preempted_before_the_load_is_planned_is_not_copied_from() -> None:
    server = Server()
    p, _, _ = planner(server)
    save = _first_saved(p)
    assert p.matched("repeat", PROMPT, 0) == 3 * CS
    p.allocated("repeat", PROMPT, 3 * CS)
    p.own.done([save.seq])  # the save is over: vLLM may have freed its blocks
    (job,) = p.plan([("repeat", PROMPT, [list(range(20, 33))], 0, 5)], [], False).loads
    assert job.source is None  # loaded from the server (a miss there is recomputed)
    # the saved request is preempted: its blocks go back to vLLM at once
    p2, clock, _ = planner(Server())
    assert p2.matched("first", PROMPT, 0) == 0
    p2.plan([("first", PROMPT, [list(range(13))], 0, len(PROMPT))], [], False)
    p2.plan([], [], True, ["first"])
    assert p2.own.source(np.asarray(PROMPT), None) is None
    assert p2.matched("repeat", PROMPT, 0) is None  # its save still counts: waited for
    clock.advance(REASK_S)
    assert p2.matched("repeat", PROMPT, 0) is None


def test_a_preemption_in_the_step_of_the_load_drops_its_source() -> None:
    p, _, _ = planner(Server())
    _first_saved(p)
    assert p.matched("repeat", PROMPT, 0) == 3 * CS
    p.allocated("repeat", PROMPT, 3 * CS)
    (job,) = p.plan([("repeat", PROMPT, [list(range(20, 33))], 0, 5)], [], True, ["someone"]).loads
    assert job.source is None


def test_a_longer_hit_on_the_server_wins_over_a_shorter_own_save() -> None:
    server = Server()
    p, _, _ = planner(server)
    p.matched("first", PROMPT, 0)
    short = PROMPT[: CS + 1]
    p.plan([("first", short, [list(range(5))], 0, len(short))], [], False)  # one chunk saved
    server.held = 3 * CS
    assert p.matched("repeat", PROMPT, 0) == 3 * CS
    p.allocated("repeat", PROMPT, 3 * CS)
    (job,) = p.plan([("repeat", PROMPT, [list(range(20, 33))], 0, 5)], [], False).loads
    assert job.source is None


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


def test_a_scheduler_that_learns_the_chunk_size_from_its_first_lookup_waits_on_it() -> None:
    server = Server(pending=3 * CS)
    p, _, _ = planner(server)
    p.chunk_size = lambda: CS if server.asked else None  # the server's first answer says it
    assert p.matched("a", PROMPT, 0) is None and len(p.waits) == 1
