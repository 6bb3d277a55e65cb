"""kvwarden as vLLM's KV connector, with real vLLM engine processes (vLLM's CPU build, from the
``.venv-vllm`` environment that ``make test`` sets up) and a real ``kvwarden serve``.

A tiny random-weight Llama is built once per session (no download; ``vllm_support``); prompts are
token ids and sampling is greedy, so every engine's output is compared token for token with the
session's engine without kvwarden (the ``reference`` fixture). vLLM's own prefix caching is off:
a cached token can only have come from kvwarden.

Two engine processes play every part, one after the other (each engine start costs about half a
minute): the first starts before its server, outlives a SIGKILL of the server and quits at the
end; the second joins once the server is back, hits the first one's chunks and is SIGKILLed, and
the first then hits the chunks the killed one stored.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from kvbench.procs import free_port
from kvbench.vllm import EngineProcess
from tests.e2e.vllm_support import (
    CHUNK,
    FRESH,
    FULL,
    PROMPT,
    SHARES_ONE,
    Reference,
    engine,
    instances,
    l1_chunks,
    reaped,
    server,
)
from tests.helpers import ServerProcess, wait_until

pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("vllm")]  # one worker: the vLLM engines

SHARED_FULL = 3 * CHUNK  # what SHARES_ONE loads once all of it is stored: 3 full chunks of 955 tokens


class Cluster:
    """The engines and servers of a test, on one pair of ports (a restarted server comes back
    where the last one was); every engine is killed and every server stopped at teardown."""

    def __init__(self, ref: Reference, tmp: Path) -> None:
        self.ref, self.tmp = ref, tmp
        self.want = ref.tokens
        self.port, self.http_port = free_port(), free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.engines: list[EngineProcess] = []
        self.servers: list[ServerProcess] = []

    def engine(self, **extra: float) -> EngineProcess:
        # (vLLM's own processes: the connector's scheduler half apart from its worker's)
        eng = engine(self.ref.models.model, self.endpoint, self.tmp, extra, one_process=False)
        self.engines.append(eng)
        return eng

    def serve(self) -> ServerProcess:
        srv = server(self.tmp / f"server-{len(self.servers)}", self.port, self.http_port)
        self.servers.append(srv)
        srv.wait_ready()
        return srv

    def close(self) -> None:
        for eng in self.engines:
            eng.kill()
        for srv in self.servers:
            srv.stop()


class Answer(NamedTuple):
    prompt: list[int]
    name: str  # the reference case of the prompt
    cached: int  # the tokens loaded from kvwarden


@pytest.fixture
def cluster(reference: Reference, tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(reference, tmp_path)
    yield c
    c.close()


def generate(c: Cluster, eng: EngineProcess, want: Answer) -> None:
    """A request whose output is the reference's, with exactly ``want.cached`` tokens loaded."""
    out = eng.generate(want.prompt)
    assert out["tokens"] == c.want[want.name], (want.name, out)
    assert out["cached"] == want.cached, (want.name, out)


def wait_l1(srv: ServerProcess, chunks: int, what: str) -> None:
    wait_until(lambda: l1_chunks(srv) == chunks, 30, 0.1, what=f"{what} ({chunks} chunks in L1)")


def starts_before_its_server(c: Cluster, first: EngineProcess) -> ServerProcess:
    """An engine that starts before its server: correct output (recompute), then it registers
    once the server is up, and its miss stores the prompt's full chunks."""
    generate(c, first, Answer(PROMPT, "prompt", 0))
    srv = c.serve()
    wait_until(
        lambda: len(instances(srv)) == 1,
        30,
        0.2,
        what="the engine's worker to register once the server is up",
    )
    (inst,) = instances(srv)
    assert inst["model_name"] == str(c.ref.models.model) and inst["transfer_mode"] == "engine_driven"
    generate(c, first, Answer(PROMPT, "prompt", 0))  # a miss: stores the prompt's full chunks
    wait_l1(srv, 4, "the miss's stores (off the step) to land")
    return srv


def survives_a_server_kill(c: Cluster, first: EngineProcess, srv: ServerProcess) -> ServerProcess:
    """The server SIGKILLed: outputs stay correct (recompute); restarted where it was, the engine
    registers again, stores, and hits its own chunks."""
    srv.proc.kill()
    srv.proc.wait(10)
    generate(c, first, Answer(PROMPT, "prompt", 0))
    srv = c.serve()
    wait_until(
        lambda: len(instances(srv)) == 1, 30, 0.2, what="the engine to register with the restarted server"
    )
    generate(c, first, Answer(PROMPT, "prompt", 0))  # L1 restarted empty: this stores
    wait_l1(srv, 4, "the store (off the step) to land")
    generate(c, first, Answer(PROMPT, "prompt", FULL))  # every full chunk but the one holding the last token
    return srv


def another_engine_hits(c: Cluster, srv: ServerProcess) -> EngineProcess:
    """A second engine process hits every chunk the first one stored (same output), then the one
    chunk a prompt shares with it, and stores the rest of that prompt."""
    second = c.engine()
    generate(c, second, Answer(PROMPT, "prompt", FULL))
    generate(c, second, Answer(SHARES_ONE, "shares_one", CHUNK))  # exactly the one chunk it shares
    wait_l1(srv, 4 + 2, "the second engine's stores of SHARES_ONE's other full chunks")
    assert len(instances(srv)) == 2  # both engines' workers, while they run
    return second


def a_killed_engine_is_reaped(second: EngineProcess, srv: ServerProcess, kept: int) -> None:
    """An engine SIGKILLed: its worker is reaped once its connection is gone for the disconnect
    grace (not after a heartbeat timeout: the reason is ``disconnect``), the other one stays."""
    second.kill()
    wait_until(
        lambda: [i["instance_id"] for i in instances(srv)] == [kept],
        30,
        0.2,
        what="the killed engine's worker to be reaped",
    )
    assert "reaped" in srv.output()
    by_reason = reaped(srv)
    assert by_reason["disconnect"] == 1 and sum(by_reason.values()) == 1, by_reason


def quits_once_its_stores_are_over(c: Cluster, first: EngineProcess, srv: ServerProcess) -> None:
    """An engine that quits right after a miss: its stores are over before it unregisters."""
    before = l1_chunks(srv)
    generate(c, first, Answer(FRESH, "fresh", 0))
    first.close()
    wait_until(lambda: not instances(srv), 30, 0.2, what="the first engine to unregister")
    assert l1_chunks(srv) == before + 4


def test_engines_share_prompt_chunks_and_survive_the_server(cluster: Cluster) -> None:
    # connects fast at start (no server yet), heartbeats fast (sees the restart soon)
    first = cluster.engine(connect_wait_s=0.5, heartbeat_interval_s=0.5)
    srv = starts_before_its_server(cluster, first)
    srv = survives_a_server_kill(cluster, first, srv)
    (kept,) = [i["instance_id"] for i in instances(srv)]
    second = another_engine_hits(cluster, srv)
    a_killed_engine_is_reaped(second, srv, kept)
    # the chunks the killed engine stored outlive it: all of SHARES_ONE's full chunks now load
    generate(cluster, first, Answer(SHARES_ONE, "shares_one", SHARED_FULL))
    quits_once_its_stores_are_over(cluster, first, srv)
