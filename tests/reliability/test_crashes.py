"""Crashes, end to end, on real processes, sockets and shared memory.

Workers SIGKILLed mid-STORE and mid-RETRIEVE while others store and retrieve: every byte any
reader gets back, during the kills and afterwards, is checked against the KV its prompt must
have (`tests.reliability.workers.kv_for`), every killed worker is reaped within the disconnect
grace, and none leaves a segment behind. Then the server itself is SIGKILLed or stopped with
SIGTERM with workers attached and restarted on the same ports: the workers answer misses at
once meanwhile, re-register by themselves and store and retrieve the right bytes again, and
the restarted server sweeps the segment of a worker that died while it was down.

Random choices (prompts, blocks, victims, kill moments) follow ``KVWARDEN_RELIABILITY_SEED``
when it is set, else a fresh seed, printed with the measurements (``pytest -s``).
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers import wait_until
from tests.reliability.workers import (
    CHUNK,
    Opts,
    Proc,
    Serve,
    env_for,
    full_tokens,
    private_shm_dir,
    prompt_set,
    segments_of,
    tracked,
)

SEED = int(os.environ.get("KVWARDEN_RELIABILITY_SEED") or time.time_ns() % 1_000_000)
GRACE_S = 1.0  # --worker-disconnect-grace-seconds


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    with private_shm_dir() as d:
        yield d


def jitter(rng: random.Random, up_to_s: float) -> None:
    """A random pause: the moment of a kill, chosen on purpose (it waits for nothing)."""
    threading.Event().wait(rng.uniform(0, up_to_s))


# ----------------------------------------------------------------- workers SIGKILLed


@dataclass
class Plan:
    writers: int  # at a time; the last one engine-driven
    readers: int  # at a time; the last one engine-driven
    writer_kills: int  # each victim is replaced by a fresh worker of its transfer mode
    reader_kills: int
    l1_gb: str  # big enough for every prompt, or not (then a stored prompt may be evicted)
    ops_between_kills: int = 4


class Kill(threading.Thread):
    """One SIGKILL, and a watch of the server until it no longer tracks the victim."""

    def __init__(self, proc: Proc, mid_request: bool, http_port: int) -> None:
        super().__init__(name=f"reap-watch-{proc.name}", daemon=True)
        self.proc = proc
        self.mid_request = mid_request  # the request the kill hit had not returned (worker's view)
        self.at = time.monotonic()
        self.http_port = http_port
        self.reaped_after: float | None = None
        self.start()

    def run(self) -> None:
        deadline = self.at + GRACE_S + 15
        pause = threading.Event()
        while time.monotonic() < deadline:
            if not tracked(self.http_port, self.proc.instance_id):
                self.reaped_after = time.monotonic() - self.at
                return
            pause.wait(0.02)  # the pace of the watch


@dataclass
class Crowd:
    tmp: Path
    server: Serve
    shm: Path
    writers: list[Proc] = field(default_factory=list)  # every one started, the dead included
    readers: list[Proc] = field(default_factory=list)
    checker: Proc | None = None
    kills: list[Kill] = field(default_factory=list)

    def spawn(self, role: str, engine: bool) -> Proc:
        procs = self.writers if role == "writer" else self.readers
        n = len(self.writers) + len(self.readers)
        mode = "engine_driven" if engine else "server_driven"
        p = Proc(
            self.tmp, f"{role}{len(procs)}", role, Opts(self.server.endpoint, mode, SEED + n, SEED), self.shm
        )
        procs.append(p)
        return p

    def procs(self) -> list[Proc]:
        return [*self.writers, *self.readers, *([self.checker] if self.checker else [])]

    def stop(self) -> None:
        """Teardown: every worker, then the server."""
        for p in self.procs():
            p.stop()
        self.server.stop()

    def done(self) -> int:
        """Stores and retrieves that returned, in all."""
        return sum(len(p.of("store_end")) + len(p.of("retrieve_end")) for p in [*self.writers, *self.readers])

    def wait_work(self, ops: int) -> None:
        """Until ``ops`` more stores and retrieves have returned."""
        target = self.done() + ops
        wait_until(lambda: self.done() >= target, 60, what=f"{ops} more stores and retrieves")


def start_crowd(tmp: Path, shm: Path, plan: Plan) -> Crowd:
    server = Serve(
        tmp,
        "--chunk-size",
        str(CHUNK),
        "--l1-size-gb",
        plan.l1_gb,
        "--worker-disconnect-grace-seconds",
        str(GRACE_S),
        "--max-transfer-workers",
        "2",
        env=env_for(shm),
    )
    crowd = Crowd(tmp, server, shm)
    try:
        # the workers start with the server: their first request waits for its socket
        for i in range(plan.writers):
            crowd.spawn("writer", i == plan.writers - 1)
        for i in range(plan.readers):
            crowd.spawn("reader", i == plan.readers - 1)
        server.wait_ready()
        for p in crowd.procs():
            p.registered()
    except BaseException:
        crowd.stop()
        raise
    return crowd


def kill_mid_request(crowd: Crowd, p: Proc, rng: random.Random) -> None:
    """SIGKILL ``p`` at a random moment shortly after it began its next request."""
    begin, end = ("store_begin", "store_end") if p in crowd.writers else ("retrieve_begin", "retrieve_end")
    ev = p.wait_for(lambda e: e.get("ev") == begin, 30, p.cursor(), begin)
    jitter(rng, 0.004)
    p.sigkill()
    ended = any(e["seq"] == ev["seq"] for e in p.of(end))
    crowd.kills.append(Kill(p, not ended, crowd.server.http_port))


def kill_round(crowd: Crowd, plan: Plan, rng: random.Random) -> None:
    """Kill writers mid-STORE and readers mid-RETRIEVE, one at a time, while the rest work, each
    replaced by a fresh worker of its role and transfer mode."""
    kinds = ["writer"] * plan.writer_kills + ["reader"] * plan.reader_kills
    rng.shuffle(kinds)
    for role in kinds:
        crowd.wait_work(plan.ops_between_kills)
        victim = rng.choice([p for p in (crowd.writers if role == "writer" else crowd.readers) if p.alive()])
        kill_mid_request(crowd, victim, rng)
        crowd.spawn(role, victim.opts.mode == "engine_driven").registered()


def check_dead_are_gone(crowd: Crowd) -> list[float]:
    """Every killed worker was reaped because its connection closed, once the disconnect grace
    had passed on the server's clock (the reason it logs: "disconnect"; a reap by silence, minutes
    later, says "timeout"), and has no segment left; returns how long each reap took after its
    kill (printed, not asserted: the watch's deadline only guards against a reap that never
    comes)."""
    for k in crowd.kills:
        k.join(GRACE_S + 20)
    took = [k.reaped_after for k in crowd.kills]
    assert all(t is not None for t in took), took
    out = crowd.server.output()
    how = {
        k.proc.instance_id: re.search(rf"reaper: reaped instance {k.proc.instance_id} \((\w+);", out)
        for k in crowd.kills
    }
    assert {iid: m and m.group(1) for iid, m in how.items()} == dict.fromkeys(how, "disconnect"), out[-3000:]
    dead = {k.proc.pid for k in crowd.kills}
    wait_until(lambda: not segments_of(crowd.shm, dead), 10, what="the dead workers' segments unlinked")
    return [t for t in took if t is not None]


def completed_stores(crowd: Crowd, prompts: list[list[int]]) -> set[int]:
    """Prompts some writer stored whole (every full chunk stored or already present)."""
    done = set()
    for w in crowd.writers:
        for e in w.of("store_end"):
            r, want = e["r"], full_tokens(prompts[e["prompt"]]) // CHUNK
            if r["chunks"] == want and r["stored"] + r["present"] == want:
                done.add(e["prompt"])
    return done


def run_crash_scenario(tmp: Path, shm: Path, plan: Plan, whole_kept: bool) -> str:
    rng = random.Random(SEED)
    prompts = prompt_set(SEED)
    t_start = time.monotonic()
    crowd = start_crowd(tmp, shm, plan)
    try:
        t0 = time.monotonic()
        kill_round(crowd, plan, rng)
        survivors = [p for p in [*crowd.writers, *crowd.readers] if p.alive()]
        crowd.wait_work(2 * len(survivors))
        for p in survivors:
            assert p.finish() == 0, p.log()
        chaos_s = time.monotonic() - t0
        reaps = check_dead_are_gone(crowd)

        # every byte a reader got during the kills was right (a partial prefix is fine)
        retrieves = [e for r in crowd.readers for e in r.of("retrieve_end")]
        assert all(not e["bad"] for e in retrieves), [e for e in retrieves if e["bad"]][:3]
        # a fresh reader, started only now, checks every prompt
        t_check = time.monotonic()
        crowd.checker = checker = Proc(
            tmp, "checker", "agent", Opts(crowd.server.endpoint, seed=200, prompts_seed=SEED), shm
        )
        checker.registered()
        results = checker.command("checked", 120, op="check_all")["results"]
        assert all(not r["bad"] for r in results), [(i, r["bad"]) for i, r in enumerate(results) if r["bad"]]
        whole = completed_stores(crowd, prompts)
        hits = [r["n"] for r in results]
        if whole_kept:  # L1 holds every prompt: a prompt stored whole comes back whole
            assert all(hits[i] == full_tokens(prompts[i]) for i in whole), (whole, hits)
        assert sum(hits) > 0
        assert checker.finish() == 0
        check_s = time.monotonic() - t_check
        # nothing is left in the segment directory but the server's L1 arena: no worker
        # segment, no engine pool
        server_pid = crowd.server.proc.pid
        wait_until(
            lambda: not [p for p in shm.iterdir() if not p.name.startswith(f"kvwarden-{server_pid}-")],
            10,
            what="a segment directory holding only the server's arena",
        )

        srv = crowd.server
        assert srv.proc.poll() is None and srv.tracebacks() == 0, srv.output()
        srv.sigterm()
        assert srv.proc.wait(30) == 0, srv.output()
        assert srv.tracebacks() == 0, srv.output()
        assert not list(shm.iterdir())  # the server unlinked its arena on the way out
        mid = sum(k.mid_request for k in crowd.kills)
        checked = sum(e["n"] for e in retrieves)
        store_s = sorted(e["s"] for w in crowd.writers for e in w.of("store_end"))
        stores = len(store_s)
        retrieve_s = sorted(e["s"] for e in retrieves)
        final_s = sorted(r["s"] for r in results)
        return (
            f"seed {SEED}: start {t0 - t_start:.1f}s; {stores} stores, "
            f"{len(retrieves)} checked retrieves ({checked} tokens) in {chaos_s:.1f}s; "
            f"{len(crowd.kills)} SIGKILLs, {mid} mid-request; reaped {min(reaps):.2f}-{max(reaps):.2f}s "
            f"after the kill (grace {GRACE_S:g}s); "
            f"final check: {sum(hits)} tokens of {len(prompts)} prompts, {len(whole)} stored whole, "
            f"in {check_s:.1f}s; median STORE {store_s[stores // 2] * 1000:.0f} ms, RETRIEVE during the "
            f"kills {retrieve_s[len(retrieve_s) // 2] * 1000:.0f} ms, after "
            f"{final_s[len(final_s) // 2] * 1000:.0f} ms"
        )
    finally:
        crowd.stop()


def test_workers_sigkilled_mid_store_and_mid_retrieve(tmp_path: Path, shm_dir: Path) -> None:
    plan = Plan(writers=4, readers=2, writer_kills=3, reader_kills=2, l1_gb="0.25", ops_between_kills=3)
    print("\n" + run_crash_scenario(tmp_path, shm_dir, plan, whole_kept=True))


@pytest.mark.slow
def test_many_workers_sigkilled_with_evictions(tmp_path: Path, shm_dir: Path) -> None:
    """More of everything, and an L1 too small for the prompt set: prompts are evicted under the
    writers and readers, and still no wrong byte comes back."""
    plan = Plan(writers=6, readers=3, writer_kills=30, reader_kills=12, l1_gb="0.012", ops_between_kills=8)
    print("\n" + run_crash_scenario(tmp_path, shm_dir, plan, whole_kept=False))


# ------------------------------------------------------------ the server SIGKILLed / stopped

HEARTBEAT_S = 0.25
# no request made while the server is down waits longer than a heartbeat for a connection
# (dataplane.client.channel), and once a transfer failed the worker holds the server unhealthy:
# the next ones answer as misses without a request. The restarted server's port is found within
# the reconnect back-off (at most 1 s), and the next PING sees the new boot token and
# re-registers. The tests check these states; the times are printed (``pytest -s``).


def wait_state(p: Proc, since: int, timeout: float, **want: object) -> float:
    """The arrival time of ``p``'s first ``state`` line from ``since`` on with the ``want`` fields."""
    p.wait_for(
        lambda e: e.get("ev") == "state" and all(e[k] == v for k, v in want.items()),
        timeout,
        since,
        f"{want}",
    )
    return next(t for t, e in p.timed("state")[::-1] if all(e[k] == v for k, v in want.items()))


def check_round(writer: Proc, reader: Proc, prompts: list[int], fresh: bool) -> None:
    """``writer`` stores ``prompts`` (each chunk newly stored when ``fresh``: prompts of different
    families share no chunk), ``reader`` gets every one back whole, byte for byte."""
    for i in prompts:
        r = writer.command("stored", op="store", prompt=i)["r"]
        assert r["chunks"] > 0 and r["rejected"] == 0, r
        assert r["stored"] + r["present"] == r["chunks"] and (not fresh or r["present"] == 0), r
        got = reader.command("retrieved", op="retrieve", prompt=i)
        assert got["bad"] == [] and got["n"] == r["chunks"] * CHUNK, got


def outage_calls(p: Proc, prompt: int) -> list[float]:
    """A store and a retrieve while no server runs: misses, counted as such by the worker, which
    then holds the server unhealthy (so its next transfers answer without a request); their
    times (printed)."""
    misses = p.command("state_now", op="state")["misses"]
    st = p.command("stored", op="store", prompt=prompt)
    rt = p.command("retrieved", op="retrieve", prompt=prompt)
    assert st["r"] == {"chunks": 0, "stored": 0, "present": 0, "rejected": 0, "skipped": 0}, st
    assert rt["n"] == 0 and rt["bad"] == [], rt
    now = p.command("state_now", op="state")
    assert now["misses"] == misses + 2 and now["healthy"] is False, (misses, now)
    return [st["s"], rt["s"]]


SWEPT = re.compile(r"shm: unlinked segment (\S+): its owner has exited")


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_server_killed_and_restarted_on_the_same_ports(
    tmp_path: Path, shm_dir: Path, how: signal.Signals
) -> None:
    env = env_for(shm_dir)
    args = ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.1", "--worker-disconnect-grace-seconds", "1")
    first = Serve(tmp_path, *args, env=env, tag="-first")
    opts = {"heartbeat": HEARTBEAT_S, "request_timeout": 10.0}
    a, b, doomed = (
        Proc(tmp_path, name, "agent", Opts(first.endpoint, mode, i, SEED, **opts), shm_dir)
        for i, (name, mode) in enumerate(
            [("a", "server_driven"), ("b", "engine_driven"), ("doomed", "server_driven")]
        )
    )
    procs = [a, b, doomed]
    second: Serve | None = None
    try:
        first.wait_ready()
        for p in procs:
            p.registered()
        # the second server imports now, and binds the same ports only when told
        second = Serve(
            tmp_path, *args, env=env, port=first.port, http_port=first.http_port, standby=True, tag="-second"
        )
        check_round(a, b, [0, 1, 2], fresh=True)
        check_round(b, a, [3, 4], fresh=True)  # engine-driven stores, server-driven retrieves
        first_pools = segments_of(shm_dir, {first.proc.pid})
        assert len(first_pools) == 2  # b's pool and the server's L1 arena

        # the server goes, with a STORE of a's just sent: drained (SIGTERM) or abandoned (SIGKILL)
        marks = {p.name: p.cursor() for p in (a, b)}
        a.send({"op": "store", "prompt": 5})
        t_down = time.monotonic()
        first.proc.send_signal(how)
        rc = first.proc.wait(30)
        assert rc == (0 if how == signal.SIGTERM else -signal.SIGKILL), first.output()
        assert first.tracebacks() == 0, first.output()
        # the STORE in flight ended (drained and served, or abandoned as a miss the moment the
        # connection closed), never by waiting out the worker's request timeout (10 s): the first
        # miss of an outage logs its reason (the wait here is only a guard, longer than that)
        last = a.ev("stored", 30, marks["a"])
        assert last["r"]["rejected"] == 0, last
        # (a heartbeat PING of 0.25 s may time out while the server drains: not the STORE's wait)
        assert "STORE: no reply within" not in a.log(), a.log()[-3000:]
        doomed.sigkill()  # dies while no server runs: its segment stays behind
        doomed_segs = doomed.info["segments"]
        assert len(doomed_segs) == 1 and (shm_dir / doomed_segs[0]).exists()
        # nothing waits on the dead server: misses, at once
        outage = outage_calls(a, 5) + outage_calls(b, 5)
        noticed = [wait_state(p, marks[p.name], 10, healthy=False) - t_down for p in (a, b)]

        # the same ports again
        marks = {p.name: p.cursor() for p in (a, b)}
        second.go()
        second.wait_ready()
        t_up = time.monotonic()  # (a worker may be back before the test's own HELLO is answered)
        # its start-up sweep took the dead worker's segment (and, after a SIGKILL, the dead
        # server's pool), and left the live worker's
        swept = set(SWEPT.findall(second.output()))
        assert swept == set(doomed_segs) | (set(first_pools) if how == signal.SIGKILL else set()), swept
        assert not segments_of(shm_dir, {doomed.pid, first.proc.pid})
        assert all((shm_dir / s).exists() for s in a.info["segments"])

        # the workers come back by themselves: a fresh registration each (the boot token changed)
        back = [
            max(0.0, wait_state(p, marks[p.name], 30, registrations=2, healthy=True) - t_up) for p in (a, b)
        ]
        assert min(w.command("state_now", op="state")["registrations"] for w in (a, b)) == 2
        assert tracked(second.http_port, a.instance_id) and tracked(second.http_port, b.instance_id)
        assert not tracked(second.http_port, doomed.instance_id)
        check_round(a, b, [0, 1, 2], fresh=True)  # the new server's L1 starts empty
        check_round(b, a, [3, 4], fresh=True)

        for p in (a, b):
            assert p.finish() == 0, p.log()
        server_pid = second.proc.pid
        wait_until(
            lambda: not [p for p in shm_dir.iterdir() if not p.name.startswith(f"kvwarden-{server_pid}-")],
            10,
            what="a segment directory holding only the server's arena",
        )
        second.sigterm()
        assert second.proc.wait(30) == 0, second.output()
        assert second.tracebacks() == 0, second.output()
        assert not list(shm_dir.iterdir())  # the server unlinked its arena on the way out
        print(
            f"\n{how.name}: outage calls {min(outage) * 1000:.0f}-{max(outage) * 1000:.0f} ms; unhealthy "
            f"{min(noticed):.2f}-{max(noticed):.2f}s after the stop; re-registered {min(back):.2f}-"
            f"{max(back):.2f}s after the restarted server answered (heartbeat {HEARTBEAT_S}s); "
            f"swept {len(swept)}; the STORE sent with the signal: {last['r']} in {last['s'] * 1000:.0f} ms"
        )
    finally:
        for p in procs:
            p.stop()
        first.stop()
        if second is not None:
            second.stop()
