"""A prompt's tail (`dataplane.client.vllm.tail`), against a real server: a kv_producer with
``store_tail`` stores it as a chunk of its own, a consumer given the handoff loads the whole
prompt but its last token and leaves every block past it alone, and no other prompt (one token
different, longer, shorter, another key context) is ever served that tail."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dataplane.client.vllm.handoff import expected, produced
from dataplane.client.vllm.lookup import ScopeLookup
from dataplane.client.vllm.settings import connector_settings
from dataplane.client.vllm.state import Planner
from dataplane.client.vllm.tail import TAIL_MARK, padded, real_length, tail_blocks, tail_end
from dataplane.client.vllm.wait import LookupFound, Waits
from dataplane.client.vllm.worker import Saver, load
from dataplane.wire.context import KeyContext
from tests.dataplane.client.vllm.test_connector_parts import (
    BS,
    CS,
    LAYERS,
    NB,
    scope,
    server,
    vllm_cpu_caches,
    worker,
)
from tests.helpers import ServerProcess, wait_until
from tests.redis_server import RedisServer

__all__ = ["server"]  # (the fixture)

PROMPT = np.arange(700, 700 + 4 * CS + 3)  # 4 full chunks, then 3 tokens: a tail of 2
END = 4 * CS + 2  # all but the last token, which vLLM computes


def test_a_tail_is_padded_with_a_mark_no_prompt_holds() -> None:
    assert tail_end(4 * CS + 3, 1, CS) == END
    assert tail_end(4 * CS + 1, 1, CS) == 0  # the full chunks cover all but the last token
    assert tail_end(4 * CS, 1, CS) == 4 * CS - 1
    assert tail_end(1, 1, CS) == 0
    t = padded(PROMPT, END, CS)
    assert len(t) == 5 * CS and (t[:END] == PROMPT[:END]).all() and (t[END:] == TAIL_MARK).all()
    assert real_length(t) == END and real_length(PROMPT) == len(PROMPT) and real_length(t[:0]) == 0
    blocks = np.arange(100, 100 + NB)
    # 130 tokens: blocks 0..8 (block 8 holds tokens 128, 129), then to the chunk's end (block 9)
    assert tail_blocks(blocks, END, CS, BS, store=True).tolist() == [*range(100, 109), 108]
    assert tail_blocks(blocks, END, CS, BS, store=False).tolist() == [*range(100, 109), -1]


def _producer(look: ScopeLookup) -> Planner:
    p = Planner(look.find, BS)
    p.chunk_size = lambda: look.chunk_size
    p.loads, p.store_tail = False, True
    look.find(np.zeros(0, dtype=np.int64))  # (learns the chunk size, as a producer's first request)
    return p


def _consumer(look: ScopeLookup, bound_s: float = 0.0) -> Planner:
    p = Planner(look.find, BS, Waits(bound_s, lambda s, o: None))
    p.chunk_size = lambda: look.chunk_size
    p.stores, p.load_tail = False, True
    return p


def test_a_consumer_loads_a_producers_tail_and_computes_only_the_last_token(server: ServerProcess) -> None:
    src, dst = vllm_cpu_caches(1), vllm_cpu_caches(2)
    untouched = [t.clone() for t in dst]
    look = ScopeLookup(server.endpoint, scope())
    try:
        prod = _producer(look)
        blocks = np.arange(NB)
        prod.matched("r", PROMPT.tolist(), 0)
        plan = prod.plan([("r", PROMPT.tolist(), [blocks.tolist()], 0, len(PROMPT))], [], False)
        assert [(len(s.tokens), s.first) for s in plan.saves] == [(4 * CS, 0), (5 * CS, 4)]
        tail = plan.saves[1]
        assert tail.names is None and real_length(tail.tokens) == END
        with worker(server) as w:
            w.register_kv_caches(src, "vllm_cpu")
            saver = Saver(w)
            saver.start()
            saver.submit(plan.saves)
            assert saver.drain(30.0)
            saver.stop()
            saver.join()
            assert (saver.stored_chunks, saver.failed) == (5, 0)
        params = produced(prod.stored("r"), None, server.endpoint)
        assert expected(params, None) == END

        cons = _consumer(look)
        assert cons.matched("d", PROMPT.tolist(), 0, None, expected(params, None)) == END
        assert cons.hit_sources("d", 0, END) == {"host": END}
        dst_blocks = np.arange(NB)[::-1].copy()  # another engine's blocks for the same prompt
        cons.allocated("d", PROMPT.tolist(), END)
        (job,) = cons.plan([("d", PROMPT.tolist(), [dst_blocks.tolist()], 0, 1)], [], False).loads
        assert real_length(job.tokens) == END and job.blocks[-1] == -1
        with worker(server) as w:
            w.register_kv_caches(dst, "vllm_cpu")
            assert load(w, job, BS) == set()
        n_held = -(-END // BS)  # blocks 0..8: the prompt up to END
        for layer in range(LAYERS):
            for i in range(n_held):
                assert torch.equal(dst[layer][dst_blocks[i]], src[layer][i])
            for b in set(range(NB)) - {int(b) for b in dst_blocks[:n_held]}:
                assert torch.equal(dst[layer][b], untouched[layer][b])  # the pad's block was never written
    finally:
        look.close()


def test_no_other_prompt_is_served_a_tail(server: ServerProcess) -> None:
    src = vllm_cpu_caches(1)
    salted = KeyContext(b"tenant-a")
    look = ScopeLookup(server.endpoint, scope())
    try:
        prod = _producer(look)
        prod.matched("r", PROMPT.tolist(), 0, salted)
        plan = prod.plan([("r", PROMPT.tolist(), [list(range(NB))], 0, len(PROMPT))], [], False)
        with worker(server) as w:
            w.register_kv_caches(src, "vllm_cpu")
            for s in plan.saves:
                assert (
                    w.store_detail(s.tokens, s.blocks, s.key, s.names, s.first).stored
                    == len(s.tokens) // CS - s.first
                )

        other = PROMPT.copy()
        other[END - 1] += 1  # the tail's last token differs
        longer = np.concatenate([PROMPT[:END], [5, 6, 7]])  # the tail's tokens, then more
        shorter = PROMPT[:END]  # its tail one token shorter
        cases = [
            (other, salted),
            (longer, salted),
            (shorter, salted),
            (PROMPT, None),
            (PROMPT, KeyContext(b"b")),
        ]
        for i, (prompt, key) in enumerate(cases):
            cons = _consumer(look)
            end = tail_end(len(prompt), 1, CS)
            got = cons.matched(f"x{i}", prompt.tolist(), 0, key, end)  # as if handed the tail
            assert got == (4 * CS if key == salted else 0), (
                i,
                got,
            )  # the full chunks at most, never the tail
            assert look.find(padded(prompt, end, CS), key).hit < 5 * CS
        assert look.find(padded(PROMPT, END, CS), salted).hit == 5 * CS
        # a consumer not handed the tail, or unable to load one, looks up the full chunks alone
        cons = _consumer(look)
        assert cons.matched("y", PROMPT.tolist(), 0, salted) == 4 * CS
        cons.load_tail = False
        assert cons.matched("z", PROMPT.tolist(), 0, salted, END) == 4 * CS
    finally:
        look.close()


def test_a_consumer_waits_for_a_named_tail_within_its_bound_then_loads_the_full_chunks() -> None:
    asked: list[int] = []

    def lookup(tokens: np.ndarray, key: KeyContext | None) -> LookupFound:
        asked.append(len(tokens))
        return LookupFound(min(len(tokens), 4 * CS))  # the full chunks, never the tail

    reports: list[str] = []
    now = [0.0]
    p = Planner(lookup, BS, Waits(1.0, lambda s, o: reports.append(o), lambda: now[0]))
    p.chunk_size, p.load_tail = (lambda: CS), True
    assert p.matched("a", PROMPT.tolist(), 0, None, END) is None  # the tail is on its way
    assert asked[-1] == 5 * CS  # the prefix and its tail, padded
    now[0] = 2.0
    assert p.matched("a", PROMPT.tolist(), 0, None, END) == 4 * CS
    assert reports == ["gave_up"]


def test_store_tail_is_a_producers_setting_and_acts() -> None:
    assert connector_settings({"kvwarden.store_tail": True}, "kv_producer")["kvwarden.store_tail"] is True
    assert connector_settings({}, "kv_producer")["kvwarden.store_tail"] is False
    for role in ("kv_both", "kv_consumer"):
        with pytest.raises(ValueError, match=rf"store_tail.*on a {role} it would do nothing"):
            connector_settings({"kvwarden.store_tail": "true"}, role)
    with pytest.raises(ValueError, match="server-driven transfers cannot load a tail"):
        connector_settings(
            {"kvwarden.store_tail": True, "kvwarden.transfer_mode": "server_driven"}, "kv_producer"
        )
    with pytest.raises(ValueError, match="is not a boolean"):
        connector_settings({"kvwarden.store_tail": "yes"}, "kv_producer")


def test_a_decode_on_another_server_sharing_redis_waits_for_the_handoff_and_loads_it(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Two hosts' servers on one Redis: the producer's chunks and tail reach Redis behind its
    answer; the consumer on the other server, handed the params at once, waits for exactly
    them (its server sees nothing on its way) and loads them from Redis."""
    servers = []
    for name in ("a", "b"):
        srv = ServerProcess(tmp_path / name, "--chunk-size", str(CS), "--remote-url", redis_server.url)
        servers.append(srv)
    look_a = look_b = None
    try:
        for srv in servers:
            srv.wait_ready()
        a, b = servers
        src, dst = vllm_cpu_caches(3), vllm_cpu_caches(4)
        look_a, look_b = ScopeLookup(a.endpoint, scope()), ScopeLookup(b.endpoint, scope())
        prod = _producer(look_a)
        prod.matched("r", PROMPT.tolist(), 0)
        plan = prod.plan([("r", PROMPT.tolist(), [list(range(NB))], 0, len(PROMPT))], [], False)
        cons = _consumer(look_b, bound_s=60.0)
        handed = expected(produced(prod.stored("r"), None, a.endpoint), None)
        assert cons.matched("d", PROMPT.tolist(), 0, None, handed) is None  # not in Redis yet: waits
        with worker(a) as w:
            w.register_kv_caches(src, "vllm_cpu")
            for s in plan.saves:
                w.store_detail(s.tokens, s.blocks, s.key, s.names, s.first)
        # the consumer asks again on later steps until every named chunk is in Redis
        got = wait_until(lambda: cons.matched("d", PROMPT.tolist(), 0, None, handed), 30, what="the handoff")
        assert got == END and cons.hit_sources("d", 0, END) == {"remote": END}
        cons.allocated("d", PROMPT.tolist(), END)
        (job,) = cons.plan([("d", PROMPT.tolist(), [list(range(NB))], 0, 1)], [], False).loads
        with worker(b) as w:
            w.register_kv_caches(dst, "vllm_cpu")
            assert load(w, job, BS) == set()
        for layer in range(LAYERS):
            assert torch.equal(dst[layer][: -(-END // BS)], src[layer][: -(-END // BS)])
    finally:
        for look in (look_a, look_b):
            if look is not None:
                look.close()
        for srv in servers:
            srv.stop()
