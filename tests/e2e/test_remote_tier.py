"""The remote tier through the public contract: real `kvwarden serve` processes sharing a real
redis-server (started here on a free port), workers through `dataplane.client`, the sidecar over
HTTP; Redis killed, paused and restarted by the tests."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import zmq

from dataplane.client import WorkerAdapter, allocate_kv_caches
from dataplane.client.vllm.lookup import Scope, ScopeLookup
from dataplane.wire.messages import KVFormat
from tests.helpers import ROOT, ServerProcess, dealer, free_port, ping, subprocess_env, wait_until
from tests.redis_server import RedisClusterServers, RedisServer

LAYERS, BLOCKS, BS, HEADS, HD = 2, 64, 16, 2, 64
CS = 128  # the server's default chunk size
INTERVAL, TIMEOUT = 0.5, 0.3  # health_ping_interval, health_ping_timeout and remote_timeout


def serve(tmp: Path, r: RedisServer | RedisClusterServers, *args: str) -> ServerProcess:
    srv = ServerProcess(
        tmp,
        "--remote-url",
        r.url,
        "--remote-timeout-seconds",
        str(TIMEOUT),
        "--health-ping-interval",
        str(INTERVAL),
        "--health-ping-timeout",
        str(TIMEOUT),
        *args,
    )
    srv.wait_ready()
    return srv


class Worker:
    def __init__(self, srv: ServerProcess, mode: str = "server_driven") -> None:
        self.caches = allocate_kv_caches(LAYERS, BLOCKS, BS, HEADS, HD, torch.bfloat16)
        self.blank()
        self.w = WorkerAdapter(srv.endpoint, "m", transfer_mode=mode, heartbeat_interval=5.0)
        self.w.register_kv_caches(self.caches)

    def fill(self, seed: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        for c in self.caches:
            c.copy_(torch.randn(c.shape, generator=g).to(torch.bfloat16))
        return [c.clone() for c in self.caches]

    def blank(self) -> None:
        for c in self.caches:
            c.zero_()

    def same(self, want: list[torch.Tensor], tokens: int) -> bool:
        """The first ``tokens`` token slots (blocks 0..) equal ``want``'s."""
        nb = tokens // BS
        return all(
            torch.equal(a[:, :nb].view(torch.int16), b[:, :nb].view(torch.int16))
            for a, b in zip(self.caches, want, strict=True)
        )

    def close(self) -> None:
        self.w.close()


def prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n)


BLOCK_IDS = np.arange(BLOCKS)


def status(srv: ServerProcess) -> dict[str, Any]:
    doc: dict[str, Any] = httpx.get(f"http://127.0.0.1:{srv.http_port}/status", timeout=10).json()
    return doc


def health(srv: ServerProcess) -> tuple[int, str]:
    r = httpx.get(f"http://127.0.0.1:{srv.http_port}/health", timeout=10)
    return r.status_code, str(r.json()["status"])


def remote(srv: ServerProcess) -> dict[str, Any]:
    doc: dict[str, Any] = status(srv)["storage"]["remote"]
    return doc


def remote_calls(srv: ServerProcess) -> tuple[Any, ...]:
    """The remote tier's counters of calls made (reads, their failures, writes): unchanged
    while no call goes to Redis."""
    r = remote(srv)
    return r["hits"], r["misses"], r["bad_values"], r["get_failures"], r["puts"], r["put_failures"]


def remote_check(doc: dict[str, Any]) -> dict[str, Any]:
    """The remote tier's check in a /status document."""
    (check,) = [c for c in doc["health"]["checks"] if c["name"].startswith("remote_backend:")]
    return check


def unread_at(port: int) -> int:
    """Bytes clients sent to local ``port`` that its server has not read (the most in one
    connection): a stopped redis-server reads nothing, so a command sent to it stays there."""
    most = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if f[3] == "01" and int(f[1].rsplit(":", 1)[1], 16) == port:  # ESTABLISHED, server side
            most = max(most, int(f[4].split(":")[1], 16))
    return most


def test_a_prefetch_brings_the_remote_prefix_into_l1_before_the_engine_asks(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Server A stores a prompt (into Redis); server B, cold, is sent PREFETCH_SCOPE for it (what
    an engine's scheduler sends for a request it was just given): B reads the prompt's chunks
    from Redis into L1 on its own, counting no lookup; then, with Redis stopped (SIGSTOP), the
    LOOKUP and the RETRIEVE are served from B's L1, byte for byte. LOOKUP_SCOPE says how much of
    its hit each server holds in L1."""
    a, b = serve(tmp_path / "a", redis_server), serve(tmp_path / "b", redis_server)
    wa = wb = None
    lookup = ScopeLookup(b.endpoint, Scope("m", 1, "bfloat16", LAYERS, HEADS, HD, KVFormat.TOKEN_MAJOR, BS))
    try:
        wa = Worker(a, "engine_driven")
        tokens = prompt(2, 3 * CS + 5)
        want = wa.fill(2)
        assert wa.w.store_detail(tokens, BLOCK_IDS).stored == 3
        wait_until(lambda: remote(a)["puts"] == 3, 20, what="the write-behind queue to drain")
        assert status(b)["storage"]["l1"]["chunks"] == 0
        on_a = ScopeLookup(a.endpoint, lookup.scope)  # A holds them in L1 too: all of it there
        try:
            warm_a = on_a.find(tokens[:-1])
        finally:
            on_a.close()
        assert (warm_a.hit, warm_a.l1) == (3 * CS, 3 * CS)
        lookup.prefetch(tokens[:-1])

        def metrics() -> str:
            return httpx.get(f"http://127.0.0.1:{b.http_port}/metrics", timeout=10).text

        wait_until(
            lambda: 'kvwarden_remote_read_ahead_total{backend="redis"} 3.0' in metrics(),
            20,
            what="B to read the prefix ahead",
        )
        text = metrics()
        assert "kvwarden_lookup_tokens_total 0.0" in text and "kvwarden_hit_tokens_total 0.0" in text
        assert "kvwarden_prefetches_total 1.0" in text
        assert status(b)["storage"]["l1"]["chunks"] == 3
        found = lookup.find(tokens[:-1])  # all of the hit now in L1: a load of it is a memory copy
        assert (found.hit, found.l1) == (3 * CS, 3 * CS)
        wb = Worker(b, "engine_driven")
        redis_server.pause()
        try:
            assert wb.w.lookup(tokens) == 3 * CS
            assert wb.w.retrieve(tokens, BLOCK_IDS) == 3 * CS
        finally:
            redis_server.resume()
        assert wb.same(want, 3 * CS) and remote(b)["hits"] == 3
    finally:
        lookup.close()
        for w in (wa, wb):
            if w is not None:
                w.close()
        a.stop()
        b.stop()


@pytest.mark.parametrize("mode", ["server_driven", "engine_driven"])
def test_a_prompt_stored_through_one_server_is_retrieved_through_another(
    tmp_path: Path, redis_server: RedisServer, mode: str
) -> None:
    # A codes what it writes (its bfloat16 KV: smaller in Redis); B, as by default, does not,
    # and reads A's chunks bit-exact all the same
    a = serve(tmp_path / "a", redis_server, "--remote-compression", "lossless")
    b = serve(tmp_path / "b", redis_server)
    wa = wb = None
    try:
        wa, wb = Worker(a, mode), Worker(b, mode)
        tokens = prompt(1, 3 * CS)
        want = wa.fill(1)
        assert wa.w.store_detail(tokens, BLOCK_IDS).stored == 3
        wait_until(lambda: remote(a)["puts"] == 3, 20, what="the write-behind queue to drain")
        assert remote(a)["url"] == redis_server.url
        ra = remote(a)
        assert ra["coded_puts"] == 3 and ra["coded_bytes_saved"] > 0, ra
        assert status(b)["storage"]["l1"]["chunks"] == 0  # B's L1 is cold
        assert wb.w.lookup(tokens) == 3 * CS
        assert wb.w.retrieve(tokens, BLOCK_IDS) == 3 * CS
        assert wb.same(want, 3 * CS)
        rb = remote(b)
        assert rb["hits"] == 3 and rb["bad_values"] == 0 and status(b)["storage"]["l1"]["chunks"] == 3
        wb.blank()
        assert wb.w.retrieve(tokens, BLOCK_IDS) == 3 * CS and remote(b)["hits"] == 3  # now from B's L1
        assert wb.same(want, 3 * CS)
        out = subprocess.run(
            [sys.executable, "-m", "app.cli", "status", "--url", f"http://127.0.0.1:{b.http_port}"],
            cwd=ROOT,
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        line = next(x for x in out.stdout.splitlines() if x.startswith("remote "))
        assert redis_server.url in line and "ping" in line and " ok " in line and "hits 3" in line
        text = httpx.get(f"http://127.0.0.1:{b.http_port}/metrics", timeout=10).text
        assert 'kvwarden_remote_duration_seconds_count{backend="redis",op="get"} 3.0' in text
        assert 'kvwarden_remote_duration_seconds_count{backend="redis",op="exists"} 1.0' in text
        assert 'kvwarden_remote_failures_total{backend="redis",kind="timeout",op="get"} 0.0' in text
        assert 'kvwarden_remote_hits_total{backend="redis"} 3.0' in text
        assert 'kvwarden_remote_coded_puts_total{backend="redis"} 0.0' in text  # (B wrote nothing)
        promtool = shutil.which("promtool")
        assert promtool, "promtool is required (`make test` installs it)"
        check = subprocess.run(
            [promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=60
        )
        assert check.returncode == 0 and not check.stdout.strip(), check.stdout + check.stderr
    finally:
        for w in (wa, wb):
            if w is not None:
                w.close()
        a.stop()
        b.stop()


def test_two_servers_share_a_three_master_redis_cluster(tmp_path: Path) -> None:
    cluster = RedisClusterServers(tmp_path / "cluster")
    a = b = None
    wa = wb = None
    try:
        # A codes its chunks: B reads them through redis-py's cluster client, and decodes them
        a = serve(tmp_path / "a", cluster, "--remote-compression", "lossless")
        b = serve(tmp_path / "b", cluster)
        wa, wb = Worker(a), Worker(b)
        tokens = prompt(9, 4 * CS)
        want = wa.fill(9)
        assert wa.w.store_detail(tokens, BLOCK_IDS).stored == 4
        wait_until(lambda: remote(a)["puts"] == 4, 20, what="the writes")
        assert remote(a)["coded_puts"] == 4
        per_node = [len(n.client().keys("kvwarden:*")) for n in cluster.nodes]
        assert sum(per_node) == 4 and max(per_node) < 4  # one prompt's chunks on several shards
        assert wb.w.lookup(tokens) == 4 * CS
        assert wb.w.retrieve(tokens, BLOCK_IDS) == 4 * CS and wb.same(want, 4 * CS)
        assert remote(b)["hits"] == 4
        assert health(b) == (200, "pass")  # the check PINGs every master
        cluster.nodes[1].kill()
        wait_until(lambda: health(b)[0] == 503, 10, interval=0.02, what="a master down is unhealthy")
    finally:
        for w in (wa, wb):
            if w is not None:
                w.close()
        for s in (a, b):
            if s is not None:
                s.stop()
        cluster.stop()


def test_damaged_values_in_redis_are_counted_misses_never_served(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    a, b = serve(tmp_path / "a", redis_server), serve(tmp_path / "b", redis_server)
    raw = redis_server.client()
    wa = wb = None
    try:
        wa, wb = Worker(a), Worker(b)
        tokens = prompt(2, 2 * CS)
        want = wa.fill(2)
        assert wa.w.store_detail(tokens[:CS], BLOCK_IDS).stored == 1
        wait_until(lambda: remote(a)["puts"] == 1, 20, what="chunk 0 written")
        (k0,) = raw.keys("kvwarden:*")
        assert wa.w.store_detail(tokens, BLOCK_IDS).stored == 1
        wait_until(lambda: remote(a)["puts"] == 2, 20, what="chunk 1 written")
        (k1,) = set(raw.keys("kvwarden:*")) - {k0}
        v0, v1 = raw.get(k0), raw.get(k1)
        assert v0 is not None and v1 is not None
        flipped = bytearray(v1)
        flipped[len(flipped) // 2] ^= 0x01
        cases = [
            (v0[: len(v0) // 2], v1, 0),  # chunk 0 truncated: nothing served
            (v1, v1, 0),  # chunk 0 holds chunk 1's bytes: refused by its key hash
            (b"not ours", v1, 0),  # a foreign value
            (v0, bytes(flipped), CS),  # chunk 1 has one byte flipped: only chunk 0 is served
        ]
        for n, (c0, c1, served) in enumerate(cases):
            raw.set(k0, c0)
            raw.set(k1, c1)
            wb.blank()
            assert wb.w.retrieve(tokens, BLOCK_IDS) == served, n
            assert wb.same(want, served)
            if served == 0:
                assert all(not c.any() for c in wb.caches)  # not a byte was written
        rb = remote(b)
        assert rb["bad_values"] == 4 and rb["get_failures"] == 0
        text = httpx.get(f"http://127.0.0.1:{b.http_port}/metrics", timeout=10).text
        assert 'kvwarden_remote_bad_values_total{backend="redis"} 4.0' in text
    finally:
        raw.close()
        for w in (wa, wb):
            if w is not None:
                w.close()
        a.stop()
        b.stop()


def test_recompute_while_redis_is_down_and_back_when_it_returns(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    srv = serve(tmp_path, redis_server)
    w = None
    try:
        w = Worker(srv)
        stored = prompt(3, 2 * CS)
        w.fill(3)
        assert w.w.store_detail(stored, BLOCK_IDS).stored == 2
        wait_until(lambda: health(srv) == (200, "pass"), 10, what="healthy")
        redis_server.kill()
        wait_until(lambda: health(srv)[0] == 503, 10, interval=0.02, what="unhealthy")
        # detected by a health round's PING (how soon: tests/dataplane/health/checks/test_remote.py)
        doc = status(srv)
        assert not doc["is_healthy"]
        assert remote_check(doc)["output"] == "ping failed (no connection or an error)", remote_check(doc)
        # degraded answers, each at once: nothing waits on the dead Redis, nothing even asks it
        before = remote_calls(srv)
        for call, degraded in (
            (lambda: w.w.lookup(stored), 0),
            (lambda: w.w.retrieve(stored, BLOCK_IDS), 0),
            (lambda: w.w.store_detail(prompt(4, 2 * CS), BLOCK_IDS).skipped, 2),
        ):
            assert call() == degraded
        assert remote_calls(srv) == before
        redis_server.start()
        wait_until(lambda: health(srv) == (200, "pass"), INTERVAL + TIMEOUT + 5, what="healthy again")
        assert w.w.retrieve(stored, BLOCK_IDS) == 2 * CS  # L1 kept it; serving again
    finally:
        if w is not None:
            w.close()
        srv.stop()
    assert "unhealthy (recompute)" in srv.output()


def test_a_hung_redis_trips_the_counter_and_recovery_waits_for_the_window_and_the_probe(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    wait_s = 3.0
    srv = serve(
        tmp_path,
        redis_server,
        "--get-blocking-failed-threshold",
        "1",
        "--waiting-time-for-recovery",
        str(wait_s),
    )
    w = None
    try:
        w = Worker(srv)
        wait_until(lambda: health(srv) == (200, "pass"), 10, what="healthy")
        redis_server.pause()  # SIGSTOP: every call waits out its timeout
        try:
            assert w.w.retrieve(prompt(5, CS), BLOCK_IDS) == 0  # not in L1: Redis is asked, times out
            assert remote(srv)["get_failures"] >= 1  # the read gave up (its timeout), counted
            wait_until(lambda: health(srv)[0] == 503, 5, interval=0.02, what="tripped")
        finally:
            redis_server.resume()
        # Redis answers again, but the counter tripped: unhealthy until the window is over
        assert health(srv)[0] == 503
        assert remote_check(status(srv))["status"] == "fail"
        # (that it waits out the whole window, on the server's clock: test_health_remote.py)
        wait_until(lambda: health(srv) == (200, "pass"), wait_s + INTERVAL + TIMEOUT + 5, what="healthy")
        # nothing stayed blocked: the server stores and reads through Redis again
        tokens = prompt(6, CS)
        want = w.fill(6)
        assert w.w.store_detail(tokens, BLOCK_IDS).stored == 1
        wait_until(lambda: remote(srv)["puts"] >= 1, 10, what="the write")
        w.blank()
        assert w.w.retrieve(tokens, BLOCK_IDS) == CS and w.same(want, CS)
    finally:
        if w is not None:
            w.close()
        srv.stop()


def test_local_cpu_bypasses_redis_and_recovery_drops_the_outages_chunks(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    srv = serve(tmp_path, redis_server, "--fallback-policy", "local_cpu", "--local-cpu", "false")
    w = None
    try:
        w = Worker(srv)
        before = prompt(7, CS)
        want_before = w.fill(7)
        assert w.w.store_detail(before, BLOCK_IDS).stored == 1
        wait_until(lambda: remote(srv)["puts"] == 1, 10, what="the write")
        wait_until(lambda: status(srv)["storage"]["l1"]["chunks"] == 0, 10, what="L1 to only stage")
        redis_server.kill()
        wait_until(lambda: health(srv) == (200, "warn"), 10, interval=0.02, what="bypassed")
        doc = status(srv)
        assert doc["is_healthy"] and doc["health"]["bypassed_backends"] == ["redis"]
        assert doc["storage"]["remote"]["bypassed"] and doc["storage"]["l1"]["hot_cache"]
        during = prompt(8, CS)
        want_during = w.fill(8)
        before = remote_calls(srv)
        assert w.w.store_detail(during, BLOCK_IDS).stored == 1  # L1 caches meanwhile
        w.blank()
        assert w.w.retrieve(during, BLOCK_IDS) == CS and w.same(want_during, CS)
        calls = remote_calls(srv)
        assert calls == before, (before, calls)  # no call went to the dead Redis (none waited on it)
        text = httpx.get(f"http://127.0.0.1:{srv.http_port}/metrics", timeout=10).text
        assert 'kvwarden_backend_bypassed{backend="redis"} 1.0' in text
        redis_server.start()  # an empty Redis: what was written before is gone with it
        wait_until(lambda: health(srv) == (200, "pass"), 10, what="recovered")
        doc = status(srv)
        assert not doc["storage"]["remote"]["bypassed"] and not doc["storage"]["l1"]["hot_cache"]
        assert doc["storage"]["l1"]["chunks"] == 0  # the outage's chunks are not served as remote
        w.blank()
        assert w.w.retrieve(during, BLOCK_IDS) == 0
        assert w.w.retrieve(before, BLOCK_IDS) == 0
        assert want_before  # (stored before the outage, lost with the killed Redis)
    finally:
        if w is not None:
            w.close()
        srv.stop()


def test_the_password_never_shows_and_a_refused_one_is_irrecoverable(tmp_path: Path) -> None:
    r = RedisServer(extra=["--requirepass", "pw-s3cret"])
    url = f"redis://:pw-s3cret@127.0.0.1:{r.port}/0"
    good = ServerProcess(tmp_path / "good", "--remote-url", url, "--health-ping-interval", str(INTERVAL))
    bad = ServerProcess(
        tmp_path / "bad",
        "--remote-url",
        f"redis://127.0.0.1:{r.port}/0",
        "--health-ping-interval",
        str(INTERVAL),
        env=subprocess_env(KVWARDEN_REMOTE_PASSWORD="not-it-pw"),
    )
    try:
        good.wait_ready()
        bad.wait_ready()
        wait_until(lambda: health(good) == (200, "pass"), 10, what="the good server healthy")
        wait_until(lambda: health(bad)[0] == 503, 10, what="the refused server unhealthy")
        assert bad.proc.poll() is None  # it still serves (recompute-only)
        doc = status(bad)
        assert "refused the credentials" in str(doc["health"]["checks"])
        for srv in (good, bad):
            seen = (
                httpx.get(f"http://127.0.0.1:{srv.http_port}/status", timeout=10).text
                + httpx.get(f"http://127.0.0.1:{srv.http_port}/metrics", timeout=10).text
                + httpx.get(f"http://127.0.0.1:{srv.http_port}/health", timeout=10).text
            )
            assert "s3cret" not in seen and "not-it" not in seen
        assert remote(good)["url"] == f"redis://:***@127.0.0.1:{r.port}/0"
    finally:
        good.stop()
        bad.stop()
        r.stop()
    for srv in (good, bad):
        assert "s3cret" not in srv.output() and "not-it" not in srv.output()
    assert bad.output().count("failed irrecoverably") == 1


def test_rediss_carries_the_tier_over_tls(tmp_path: Path) -> None:
    openssl = shutil.which("openssl")
    assert openssl, "openssl is required (`make test` installs it)"
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    tls_port = free_port()
    r = RedisServer(
        extra=[
            "--tls-port",
            str(tls_port),
            "--tls-cert-file",
            str(cert),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(cert),
            "--tls-auth-clients",
            "no",
        ]
    )
    url = f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}"
    a = ServerProcess(tmp_path / "a", "--remote-url", url, "--health-ping-interval", str(INTERVAL))
    b = ServerProcess(tmp_path / "b", "--remote-url", url, "--health-ping-interval", str(INTERVAL))
    untrusted = ServerProcess(  # the server's certificate is not one it trusts
        tmp_path / "u",
        "--remote-url",
        f"rediss://127.0.0.1:{tls_port}/0",
        "--health-ping-interval",
        str(INTERVAL),
    )
    wa = wb = None
    try:
        for s in (a, b, untrusted):
            s.wait_ready()
        wa, wb = Worker(a), Worker(b)
        tokens = prompt(10, 2 * CS)
        want = wa.fill(10)
        assert wa.w.store_detail(tokens, BLOCK_IDS).stored == 2
        wait_until(lambda: remote(a)["puts"] == 2, 20, what="the writes over TLS")
        assert wb.w.retrieve(tokens, BLOCK_IDS) == 2 * CS and wb.same(want, 2 * CS)
        assert health(b) == (200, "pass")
        wait_until(lambda: health(untrusted)[0] == 503, 10, what="the untrusted server unhealthy")
    finally:
        for w in (wa, wb):
            if w is not None:
                w.close()
        for s in (a, b, untrusted):
            s.stop()
        r.stop()


def test_a_server_starts_while_redis_is_away_and_uses_it_once_it_is_up(tmp_path: Path) -> None:
    port = free_port()
    srv = ServerProcess(
        tmp_path,
        "--remote-url",
        f"redis://127.0.0.1:{port}/0",
        "--remote-timeout-seconds",
        str(TIMEOUT),
        "--health-ping-interval",
        str(INTERVAL),
        "--health-ping-timeout",
        str(TIMEOUT),
    )
    r = None
    w = None
    try:
        srv.wait_ready()  # serving, though its remote tier is not there
        wait_until(lambda: health(srv)[0] == 503, 10, what="unhealthy while Redis is away")
        w = Worker(srv)
        assert w.w.store_detail(prompt(11, CS), BLOCK_IDS).skipped == 1
        r = RedisServer(port)
        wait_until(lambda: health(srv) == (200, "pass"), 10, what="healthy once Redis is up")
        tokens = prompt(12, CS)
        want = w.fill(12)
        assert w.w.store_detail(tokens, BLOCK_IDS).stored == 1
        wait_until(lambda: remote(srv)["puts"] == 1, 10, what="the write")
        w.blank()
        assert w.w.retrieve(tokens, BLOCK_IDS) == CS and w.same(want, CS)
    finally:
        if w is not None:
            w.close()
        srv.stop()
        if r is not None:
            r.stop()


def test_a_one_copy_acquire_that_needs_a_hung_redis_never_holds_up_the_loop_thread(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """B's one-copy ACQUIRE (small enough to be answered on the loop thread) asks for chunks only
    Redis holds while Redis is stopped (SIGSTOP): the read waits out its timeout on the transfer
    pool, and B answers a PING sent while that read is outstanding. Once Redis resumes, the same
    ACQUIRE reads the chunks from it, and the next one finds them in B's L1."""
    hang_s = 3.0  # remote_timeout_seconds: how long the read waits on the stopped Redis
    args = ["--remote-url", redis_server.url, "--remote-timeout-seconds", str(hang_s)]
    args += ["--health-ping-interval", "600"]  # no health round meanwhile
    a, b = ServerProcess(tmp_path / "a", *args), ServerProcess(tmp_path / "b", *args)
    wa = wb = None
    ctx: zmq.Context[Any] = zmq.Context()
    pinger = dealer(ctx, b.endpoint)
    try:
        a.wait_ready()
        b.wait_ready()
        wa, wb = Worker(a, "engine_driven"), Worker(b, "engine_driven")
        assert status(b)["storage"]["l1"]["arena"]["backing"] == "shm"  # one-copy: ENGINE_ACQUIRE
        tokens = prompt(8, 2 * CS)
        want = wa.fill(8)
        assert wa.w.store_detail(tokens, BLOCK_IDS).stored == 2
        wait_until(lambda: remote(a)["puts"] == 2, 20, what="the write-behind queue to drain")
        assert status(b)["storage"]["l1"]["chunks"] == 0  # only Redis holds them
        ping(pinger, timeout=5)
        assert remote(b)["get_failures"] == 0
        got: list[int] = []
        retrieve = threading.Thread(target=lambda: got.append(wb.w.retrieve(tokens, BLOCK_IDS)))
        redis_server.pause()
        try:
            retrieve.start()
            # B's read went out: the stopped Redis holds its command unread, B waits for it ...
            wait_until(lambda: unread_at(redis_server.port) > 0, 10, what="B's read sent to Redis")
            ping(pinger, timeout=2 * hang_s)  # ... and a PING sent after it is answered ...
            # ... before that read ended (nothing failed yet: it gives up after hang_s): had the
            # loop thread made the read, it could answer no PING until the read was over
            assert remote(b)["get_failures"] == 0 and retrieve.is_alive()
            retrieve.join(30)
        finally:
            redis_server.resume()
            retrieve.join(30)
        assert got == [0]  # it did wait on Redis, on the transfer pool, until its timeout
        assert remote(b)["get_failures"] >= 1
        wb.blank()
        assert wb.w.retrieve(tokens, BLOCK_IDS) == 2 * CS and wb.same(want, 2 * CS)  # read from Redis
        hits = remote(b)["hits"]
        assert hits == 2 and status(b)["storage"]["l1"]["chunks"] == 2
        wb.blank()
        assert wb.w.retrieve(tokens, BLOCK_IDS) == 2 * CS and wb.same(want, 2 * CS)  # from B's L1
        assert remote(b)["hits"] == hits
    finally:
        pinger.close(linger=0)
        ctx.term()
        for w in (wa, wb):
            if w is not None:
                w.close()
        a.stop()
        b.stop()
