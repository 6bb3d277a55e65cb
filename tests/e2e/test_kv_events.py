"""KV events through the public contract: real `kvwarden serve` processes publishing on real
ZMQ sockets, workers storing through `dataplane.client`, a subscriber and the replay socket over
ZMQ, and every payload decoded by vLLM's own event classes (msgspec, in vLLM's environment)."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from dataplane.client.keys import key_context
from dataplane.client.vllm.lookup import Scope, ScopeLookup
from dataplane.events.describe import native_hash
from dataplane.storage.keys import chunk_keys, scope_digest
from dataplane.wire.blocks import EngineBlocks
from dataplane.wire.errors import RequestError
from dataplane.wire.kinds import KVFormat
from tests.e2e.test_fs_tier import chunk_files, fs_doc
from tests.e2e.test_remote_tier import BLOCK_IDS, BS, CS, HD, HEADS, LAYERS, Worker, prompt
from tests.e2e.vllm_support import VLLM_PYTHON
from tests.helpers import ROOT, ServerProcess, free_port, subprocess_env, wait_until
from tests.redis_server import RedisServer

CHUNK_BYTES = LAYERS * 2 * CS * HEADS * HD * 2  # bf16
END_SEQ = (-1).to_bytes(8, "big", signed=True)
SCOPE = scope_digest("m", 1, 0, "bfloat16", LAYERS, HEADS, HD)


class Decoder:
    """vLLM's decoder in vLLM's environment, one process for the module."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [str(VLLM_PYTHON), str(ROOT / "tests" / "e2e" / "kv_events_decode.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=subprocess_env(),
        )
        assert self.proc.stdout is not None
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}

    def decode(self, payload: bytes) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(base64.b64encode(payload).decode() + "\n")
        self.proc.stdin.flush()
        out: dict[str, Any] = json.loads(self.proc.stdout.readline())
        assert "error" not in out, out
        return out

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


@pytest.fixture(scope="module")
def decoder() -> Iterator[Decoder]:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: `make vllm-env` sets up vLLM's environment (make test does)")
    d = Decoder()
    yield d
    d.close()


class Events:
    """A server publishing events, and what a subscriber and the replay socket see of them."""

    def __init__(self, tmp: Path, *args: str, topic: str = "kv@pod-a@m") -> None:
        self.pub_port, self.replay_port = free_port(), free_port()
        self.topic = topic
        self.srv = ServerProcess(
            tmp,
            "--kv-events-endpoint",
            f"tcp://*:{self.pub_port}",
            "--kv-events-replay-endpoint",
            f"tcp://*:{self.replay_port}",
            "--kv-events-topic",
            topic,
            *args,
        )
        self.srv.wait_ready()
        self.ctx: zmq.Context[Any] = zmq.Context()

    def subscriber(self, hwm: int = 1000) -> zmq.Socket[Any]:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, hwm)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            sub.connect(f"tcp://127.0.0.1:{self.pub_port}")
            # connected before anything is published (the subscription goes with the handshake):
            # a subscriber that joined late would see none of what follows
            assert monitor.poll(10_000), "the subscriber never connected"
            recv_monitor_message(monitor)
        finally:
            sub.disable_monitor()
            monitor.close(0)
        return sub

    def replay(self, start: int = 0) -> list[tuple[int, bytes]]:
        """Every buffered batch from ``start`` (sequence, payload), through the replay socket."""
        return replay_batches(self.replay_port, self.topic.encode(), start)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"http://127.0.0.1:{self.srv.http_port}/metrics", timeout=10).text
        return {
            m[1]: float(m[2]) for m in re.finditer(r"^(kvwarden_kv_event[^ ]*) ([0-9.e+-]+)$", text, re.M)
        }

    def close(self) -> None:
        self.ctx.destroy(0)
        self.srv.stop()


def replay_batches(port: int, topic: bytes = b"", start: int = 0) -> list[tuple[int, bytes]]:
    """Every batch a publisher still holds from ``start`` (sequence, payload), through its
    replay socket: vLLM's and kvwarden's answer alike."""
    ctx: zmq.Context[Any] = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{port}")
    try:
        s.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert s.poll(10_000), "no answer from the replay socket"
            _, t, seq, payload = s.recv_multipart()
            if seq == END_SEQ:
                return out
            assert t == topic
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        ctx.destroy(0)


def events_of(dec: Decoder, batches: list[tuple[int, bytes]]) -> list[dict[str, Any]]:
    return [ev for _, payload in batches for ev in dec.decode(payload)["events"]]


def stored(hashes: list[int], parent: int | None, tokens: np.ndarray, medium: str = "CPU") -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": [int(t) for t in tokens],
        "block_size": CS,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "ownership": "kvwarden",
    }


def removed(hashes: list[int], medium: str = "CPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "ownership": "kvwarden"}


def native(tokens: np.ndarray) -> list[int]:
    return [native_hash(k) for k in chunk_keys(SCOPE, tokens, CS)]


def chunk_events(tokens: np.ndarray, medium: str = "CPU") -> list[dict[str, Any]]:
    """The BlockStored events of every chunk of ``tokens``, without engine names."""
    h = native(tokens)
    return [
        stored([h[i]], h[i - 1] if i else None, tokens[i * CS : (i + 1) * CS], medium) for i in range(len(h))
    ]


def test_stores_and_evictions_publish_exactly_these_events_in_order_without_gaps(
    tmp_path: Path, decoder: Decoder
) -> None:
    ev = Events(tmp_path, "--l1-size-gb", repr(4 * CHUNK_BYTES / (1 << 30)))
    w = None
    try:
        sub = ev.subscriber()
        w = Worker(ev.srv)
        a, b, c = prompt(1, 2 * CS), prompt(2, 2 * CS), prompt(3, 2 * CS)
        w.fill(1)
        for p in (a, b, c):  # L1 holds 4 chunks: c evicts a's two, oldest first
            assert w.w.store_detail(p, BLOCK_IDS).stored == 2
        want = [{"type": "AllBlocksCleared"}, *chunk_events(a), *chunk_events(b)]
        ha = native(a)
        cc = chunk_events(c)  # each of c's chunks evicts one of a's, oldest first, then lands
        want += [removed([ha[0]]), cc[0], removed([ha[1]]), cc[1]]
        wait_until(lambda: ev.metrics().get("kvwarden_kv_events_held_chunks") == 4, 10, what="events out")
        history = ev.replay(0)
        assert [s for s, _ in history] == list(range(len(history)))  # no gap, from 0
        got = events_of(decoder, history)
        assert got == want
        # the live subscriber saw the same batches, each once, in order (it may have joined late)
        live = []
        while sub.poll(1000):
            topic, seq, payload = sub.recv_multipart()
            assert topic == ev.topic.encode()
            live.append((int.from_bytes(seq, "big"), payload))
        assert live and live == history[len(history) - len(live) :]
        m = ev.metrics()
        assert m['kvwarden_kv_events_total{type="BlockStored"}'] == 6
        assert m['kvwarden_kv_events_total{type="BlockRemoved"}'] == 2
        assert m["kvwarden_kv_events_dropped_total"] == 0
        # a replay from the middle returns the rest only
        assert ev.replay(2) == history[2:]
    finally:
        if w is not None:
            w.close()
        ev.close()


@pytest.mark.parametrize("mode", ["server_driven", "engine_driven"])
def test_a_store_with_the_engines_names_publishes_them(tmp_path: Path, decoder: Decoder, mode: str) -> None:
    ev = Events(tmp_path)
    w = None
    try:
        w = Worker(ev.srv, mode)
        tokens = prompt(4, 3 * CS + 5)  # three chunks, and 5 tokens no chunk holds
        blocks = len(tokens) // BS
        hashes = [(0xABC << 40) + i for i in range(blocks)]  # as vLLM's integer block hashes are
        extra = [["lora-x"] if i % 2 else None for i in range(blocks)]
        names = EngineBlocks(
            BS, tuple(hashes), "lora-x", tuple(None if e is None else tuple(e) for e in extra)
        )
        w.fill(2)
        assert w.w.store_detail(tokens, BLOCK_IDS, names=names).stored == 3
        wait_until(lambda: ev.metrics().get("kvwarden_kv_events_held_chunks") == 3, 10, what="events out")
        got = events_of(decoder, ev.replay(0))
        per = CS // BS
        want = [{"type": "AllBlocksCleared"}]
        for c in range(3):
            lo = c * per
            want.append(
                {
                    **stored(
                        hashes[lo : lo + per], hashes[lo - 1] if lo else None, tokens[c * CS : (c + 1) * CS]
                    ),
                    "block_size": BS,
                    "lora_name": "lora-x",
                    "extra_keys": extra[lo : lo + per],
                }
            )
        assert got == want
        # names that cannot name the chunks are refused, naming the field; the server lives on
        with pytest.raises(RequestError, match=r"blocks\.block_size: 48 does not divide"):
            w.w.store_detail(tokens, BLOCK_IDS, names=EngineBlocks(48, tuple(hashes)))
        fewer = rf"blocks\.hashes: 5 hashes name fewer than the {3 * per} blocks"
        with pytest.raises(RequestError, match=fewer):
            w.w.store_detail(tokens, BLOCK_IDS, names=EngineBlocks(BS, tuple(hashes[:5])))
        assert w.w.store_detail(prompt(5, CS), BLOCK_IDS).stored == 1
    finally:
        if w is not None:
            w.close()
        ev.close()


def test_a_subscriber_that_stops_reading_does_not_hold_back_stores(tmp_path: Path, decoder: Decoder) -> None:
    ev = Events(tmp_path, "--l1-size-gb", repr(8 * CHUNK_BYTES / (1 << 30)))
    w = None
    try:
        stuck = ev.subscriber(hwm=1)  # never read: its pipe fills at once
        w = Worker(ev.srv)
        w.fill(3)
        n = 300
        t0 = time.monotonic()
        for i in range(n):
            assert w.w.store_detail(prompt(100 + i, CS), BLOCK_IDS).stored == 1
        took = time.monotonic() - t0
        m = wait_until(
            lambda: (m := ev.metrics())['kvwarden_kv_events_total{type="BlockStored"}'] == n and m, 10
        )
        assert m['kvwarden_kv_events_total{type="BlockRemoved"}'] == n - 8
        assert m["kvwarden_kv_events_dropped_total"] == 0 and m["kvwarden_kv_events_queued"] == 0
        assert took < 60, took
        # a late subscriber learns the last batches from the replay socket, decodable as ever
        history = ev.replay(0)
        assert [s for s, _ in history] == list(range(len(history)))
        assert sum(e["type"] == "BlockStored" for e in events_of(decoder, history)) == n
        assert stuck.poll(0)  # (it was sent what fit its pipe, and is still connected)
    finally:
        if w is not None:
            w.close()
        ev.close()


def test_the_file_tier_publishes_disk_stores_and_evictions(tmp_path: Path, decoder: Decoder) -> None:
    root = tmp_path / "fs"
    root.mkdir()
    header = 4096  # room for a file's header, per chunk
    cap = 2 * (CHUNK_BYTES + header) / (1 << 30)
    ev = Events(tmp_path, "--fs-path", str(root), "--fs-size-gb", repr(cap))
    w = None
    try:
        w = Worker(ev.srv)
        w.fill(4)
        a, b = prompt(7, 2 * CS), prompt(8, CS)
        assert w.w.store_detail(a, BLOCK_IDS).stored == 2
        wait_until(lambda: fs_doc(ev.srv)["puts"] == 2 and fs_doc(ev.srv)["queue_depth"] == 0, 20)
        assert w.w.store_detail(b, BLOCK_IDS).stored == 1  # its file evicts a's first
        wait_until(lambda: fs_doc(ev.srv)["puts"] == 3 and fs_doc(ev.srv)["queue_depth"] == 0, 20)
        assert len(chunk_files(root)) == 2
        wait_until(lambda: ev.metrics().get('kvwarden_kv_events_total{type="BlockRemoved"}') == 1, 10)
        got = [e for e in events_of(decoder, ev.replay(0)) if e.get("medium") == "DISK"]
        ca, cb = chunk_events(a, "DISK"), chunk_events(b, "DISK")
        assert got == [ca[0], ca[1], removed([native(a)[0]], "DISK"), cb[0]]
    finally:
        if w is not None:
            w.close()
        ev.close()


def test_a_clear_publishes_the_removal_of_every_chunk_it_removes_to_a_live_subscriber(
    tmp_path: Path, decoder: Decoder
) -> None:
    root = tmp_path / "fs"
    root.mkdir()
    ev = Events(tmp_path, "--fs-path", str(root), "--fs-size-gb", "0.0625")
    w = look = None
    try:
        sub = ev.subscriber()
        w = Worker(ev.srv)
        w.fill(5)
        a, b = prompt(9, 2 * CS), prompt(10, CS)
        for p in (a, b):
            assert w.w.store_detail(p, BLOCK_IDS).stored == len(p) // CS
        wait_until(lambda: fs_doc(ev.srv)["puts"] == 3 and fs_doc(ev.srv)["queue_depth"] == 0, 20)
        # what a vLLM engine's reset sends: CLEAR_SCOPE for its scope
        look = ScopeLookup(
            ev.srv.endpoint, Scope("m", 1, "bfloat16", LAYERS, HEADS, HD, KVFormat.TOKEN_MAJOR, BS)
        )
        assert look.clear()
        wait_until(lambda: ev.metrics().get('kvwarden_kv_events_total{type="BlockRemoved"}') == 6, 10)
        live = []
        while sub.poll(1000):
            topic, seq, payload = sub.recv_multipart()
            assert topic == ev.topic.encode()
            live.append((int.from_bytes(seq, "big"), payload))
        history = ev.replay(0)
        # the subscriber saw every batch since it joined (the start's AllBlocksCleared may be before)
        assert len(live) >= len(history) - 1 and live == history[len(history) - len(live) :]
        got = events_of(decoder, live)
        stores = [e for e in got if e["type"] == "BlockStored"]
        assert len(stores) == 6 and got.index(stores[-1]) < min(
            i for i, e in enumerate(got) if e["type"] == "BlockRemoved"
        )  # (the removals come after every store)
        gone = {(e["medium"], h) for e in got if e["type"] == "BlockRemoved" for h in e["block_hashes"]}
        held = native(a) + native(b)
        assert gone == {(medium, h) for medium in ("CPU", "DISK") for h in held}
        assert tiers(ev.srv, a)[:3] == (0, 0, 0)
    finally:
        if look is not None:
            look.close()
        if w is not None:
            w.close()
        ev.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kv-events-replay-endpoint", "tcp://*:5999"], "need kv_events_endpoint (events are off)"),
        (["--kv-events-topic", "kv@p@m"], "need kv_events_endpoint (events are off)"),
        (["--kv-events-endpoint", "udp://x:1"], "must start with tcp://, ipc:// or inproc://"),
    ],
)
def test_event_settings_that_would_do_nothing_are_refused(args: list[str], message: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "serve", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=subprocess_env(),
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert message in out.stderr


def test_an_endpoint_in_use_fails_the_start_naming_it(tmp_path: Path) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        srv = ServerProcess(tmp_path, "--kv-events-endpoint", f"tcp://*:{port}")
        rc = srv.proc.wait(120)
        assert rc == 1, srv.output()
        assert f"kv_events_endpoint tcp://*:{port}: Address already in use" in srv.output()
    finally:
        ctx.destroy(0)


def lookup(srv: ServerProcess, *requests: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"http://127.0.0.1:{srv.http_port}/v1/lookup", json={"requests": list(requests)}, timeout=30
    )


def tiers(srv: ServerProcess, tokens: np.ndarray, **kw: Any) -> tuple[int, int, int, bool]:
    r = lookup(srv, {"model": "m", "token_ids": [int(t) for t in tokens], **kw})
    assert r.status_code == 200, r.text
    (res,) = r.json()["results"]
    assert res["tokens"] == len(tokens) and res["chunk_size"] == CS
    return res["cpu_tokens"], res["disk_tokens"], res["total_tokens"], res["model_known"]


def by_hashes(srv: ServerProcess, hashes: list[Any], model: str = "m") -> tuple[int, int]:
    r = lookup(srv, {"model": model, "block_hashes": hashes, "block_size": BS})
    assert r.status_code == 200, r.text
    (res,) = r.json()["results"]
    return res["tokens"], res["total_tokens"]


def test_the_lookup_route_answers_each_tier_within_salt_and_adapter(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    root.mkdir()
    srv = ServerProcess(
        tmp_path,
        "--l1-size-gb",
        repr(4 * CHUNK_BYTES / (1 << 30)),
        "--fs-path",
        str(root),
        "--fs-size-gb",
        "1",
    )
    w = None
    try:
        srv.wait_ready()
        w = Worker(srv)
        w.fill(5)
        a, b, c = prompt(21, 2 * CS + 7), prompt(22, 2 * CS), prompt(23, 2 * CS)
        salted = key_context("tenant-a")
        assert w.w.store_detail(a, BLOCK_IDS, salted).stored == 2
        assert tiers(srv, a, salt="tenant-a")[0] == 2 * CS
        assert tiers(srv, a) == (0, 0, 0, True)  # a salted prefix is found only with its salt
        assert tiers(srv, a, salt="tenant-b")[2] == 0
        r = lookup(srv, {"model": "no-such-model", "token_ids": [int(t) for t in a]})
        assert r.json()["results"][0] == {
            "tokens": len(a), "chunk_size": CS, "cpu_tokens": 0, "disk_tokens": 0,
            "external_tokens": 0, "total_tokens": 0, "model_known": False,
        }  # fmt: skip
        # an adapter is asked for by the name its stores gave it
        names = EngineBlocks(BS, tuple(range(len(b) // BS)), "lora-x")
        lora = key_context(None, b"lora:x-namespace")
        assert w.w.store_detail(b, BLOCK_IDS, lora, names).stored == 2
        assert tiers(srv, b, adapter="lora-x")[2] == 2 * CS
        assert tiers(srv, b)[2] == 0 and tiers(srv, b, adapter="lora-y")[2] == 0
        # or by the engine's block hashes (they hold the salt and the adapter)
        assert by_hashes(srv, list(names.hashes)) == (2 * CS, 2 * CS)
        per = CS // BS  # blocks a chunk
        assert by_hashes(srv, list(names.hashes[: per + 4])) == ((per + 4) * BS, CS)  # one whole chunk named
        assert by_hashes(srv, [*names.hashes[: 2 * per - 1], 999]) == (2 * CS, CS)  # diverges in chunk 1
        assert by_hashes(srv, list(names.hashes), model="other") == (2 * CS, 0)
        wait_until(lambda: fs_doc(srv)["puts"] == 4 and fs_doc(srv)["queue_depth"] == 0, 20)
        cpu, disk, total, _ = tiers(srv, a, salt="tenant-a")
        assert (cpu, disk, total) == (2 * CS, 2 * CS, 2 * CS)
        # asking touches nothing: a, asked about last, is still the oldest and c evicts it from L1
        assert w.w.store_detail(c, BLOCK_IDS).stored == 2
        assert tiers(srv, a, salt="tenant-a")[:3] == (0, 2 * CS, 2 * CS)  # on disk only now
        assert tiers(srv, b, adapter="lora-x")[0] == 2 * CS
    finally:
        if w is not None:
            w.close()
        srv.stop()


@pytest.mark.parametrize(
    ("body", "code", "message"),
    [
        ({"requests": []}, 422, "at least 1 item"),
        ({"requests": [{"model": "m", "token_ids": [1]}] * 65}, 422, "at most 64 items"),
        (
            {"requests": [{"model": "m", "token_ids": [-1]}]},
            422,
            "greater than or equal to 0",
        ),
        # a prompt is named one way: by token ids, or by block hashes and block size
        ({"requests": [{"model": "m", "token_ids": [1], "block_hashes": [1]}]}, 422, '"block_hashes"]'),
        ({"requests": [{"model": "m", "block_hashes": [1]}]}, 422, '"block_size"],"msg":"Field required"'),
        ({"requests": [{"model": "m", "token_ids": [1], "block_size": 16}]}, 422, '"block_size"]'),
        (
            {"requests": [{"model": "m", "block_hashes": [1], "block_size": 16, "salt": "t"}]},
            422,
            '"salt"],"msg":"Extra inputs are not permitted"',
        ),
        ({"requests": [{"model": "m", "block_hashes": [-1], "block_size": 16}]}, 422, '"block_hashes",0]'),
        ({"requests": [{"model": "m", "token_ids": [1], "extra": 1}]}, 422, "extra"),
        ({"requests": [{"model": "", "token_ids": [1]}]}, 422, "at least 1 character"),
        ({"requests": [{"model": "m", "token_ids": [1] * (1 << 19)}] * 3}, 413, "over the limit of 1048576"),
    ],
)
def test_the_lookup_route_refuses_bad_batches_naming_the_problem(
    tmp_path: Path, body: dict[str, Any], code: int, message: str
) -> None:
    srv = lookup_server(tmp_path)
    r = httpx.post(f"http://127.0.0.1:{srv.http_port}/v1/lookup", json=body, timeout=60)
    assert r.status_code == code, r.text
    assert message in r.text
    assert srv.proc.poll() is None


_SERVER: dict[str, ServerProcess] = {}


def lookup_server(tmp: Path) -> ServerProcess:
    """One server for the bad-input cases (they change nothing)."""
    srv = _SERVER.get("s")
    if srv is None or srv.proc.poll() is not None:
        srv = _SERVER["s"] = ServerProcess(tmp)
        srv.wait_ready()
    return srv


@pytest.fixture(scope="module", autouse=True)
def _stop_lookup_server() -> Iterator[None]:
    yield
    for srv in _SERVER.values():
        srv.stop()


@pytest.mark.parametrize("policy", ["local_cpu", "recompute"])
def test_the_health_fallback_withdraws_what_it_stops_serving(
    tmp_path: Path, decoder: Decoder, redis_server: RedisServer, policy: str
) -> None:
    """The remote tier's chunks are announced once written; Redis killed: under local_cpu the
    bypass withdraws them (BlockRemoved EXTERNAL, L1's stay), under recompute the server turns
    unhealthy and everything is void (AllBlocksCleared)."""
    timing = [
        "--health-ping-interval",
        "0.3",
        "--health-ping-timeout",
        "0.3",
        "--remote-timeout-seconds",
        "0.3",
    ]
    ev = Events(tmp_path, "--remote-url", redis_server.url, "--fallback-policy", policy, *timing)
    w = None
    try:
        w = Worker(ev.srv)
        w.fill(6)
        a = prompt(31, 2 * CS)
        assert w.w.store_detail(a, BLOCK_IDS).stored == 2
        wait_until(lambda: ev.metrics().get('kvwarden_kv_events_total{type="BlockStored"}') == 4, 10)
        redis_server.kill()
        kind = "BlockRemoved" if policy == "local_cpu" else "AllBlocksCleared"
        want = 1 if policy == "local_cpu" else 2  # (the first batch of every process clears too)
        wait_until(lambda: ev.metrics().get(f'kvwarden_kv_events_total{{type="{kind}"}}') == want, 20)
        got = events_of(decoder, ev.replay(0))
        h = native(a)
        stored_ = [*chunk_events(a), *chunk_events(a, "EXTERNAL")]
        assert sorted(map(json.dumps, got[1:5])) == sorted(map(json.dumps, stored_))  # (writes race L1)
        if policy == "local_cpu":
            assert got[5:] == [removed(h, "EXTERNAL")]  # one event for the whole tier; L1's stay
            assert ev.metrics()["kvwarden_kv_events_held_chunks"] == 2
        else:
            assert got[5:] == [{"type": "AllBlocksCleared"}]
            assert ev.metrics()["kvwarden_kv_events_held_chunks"] == 0
    finally:
        if w is not None:
            w.close()
        ev.close()
