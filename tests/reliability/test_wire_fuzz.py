"""Wire fuzzing against a real `kvwarden serve` process: frames sent back to back over one
DEALER socket (a fresh one every round), replies matched by request id.

The frames (`tests.reliability.wire_strategies`): first a sweep of every field of every message
type through edge values, then Hypothesis-generated batches of every shape.

Oracle, for every frame: a reply arrives within ``REPLY_TIMEOUT_S``, carrying the envelope that
was sent; a frame the reference decoder (`dataplane.wire.protocol`) refuses gets that decoder's
error code with the request id it can read; a valid request gets an ok reply or a refusal of a
known code, never INTERNAL; a PING probe sent after every batch answers. At the end the process
is alive, its log has no "Traceback", and it exits 0 on SIGTERM.

Frame counts: ``KVWARDEN_WIRE_FUZZ_FRAMES`` (default 3,000) in the default run,
``KVWARDEN_WIRE_FUZZ_SOAK_FRAMES`` (default 100,000) in the slow test (``KVWARDEN_SLOW=1``).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from dataplane.client import allocate_kv_caches, free_kv_caches
from dataplane.wire.errors import KVWardenError
from dataplane.wire.messages import Ping
from dataplane.wire.protocol import decode_reply, decode_request, encode_message, peek_request_id, unpack
from tests.conftest import ServerFactory
from tests.helpers import ServerProcess, dealer, ping
from tests.reliability.wire_strategies import (
    CHUNK,
    LAYOUT,
    MAX_FRAME,
    Geometry,
    Shot,
    geometry,
    setup_shots,
    shots,
    sweep_shots,
)

DEFAULT_FRAMES = int(os.environ.get("KVWARDEN_WIRE_FUZZ_FRAMES", "3000"))
SOAK_FRAMES = int(os.environ.get("KVWARDEN_WIRE_FUZZ_SOAK_FRAMES", "100000"))
EXAMPLES_PER_ROUND = 150  # Hypothesis examples (batches) per round; each round: a new socket, seed
MAX_BATCH = 16  # frames per example, sent back to back before the replies are read
REPLY_TIMEOUT_S = 10.0  # the bound on every reply of a batch
# every code a reply may carry: INTERNAL (a handler failure) and SHUTTING_DOWN are not among them
KNOWN_CODES = frozenset(
    {
        "BAD_REQUEST",
        "FRAME_TOO_LARGE",
        "VERSION_MISMATCH",
        "NOT_REGISTERED",
        "NOT_OWNER",
        "INVALID_LAYOUT",
        "REQUEST_REFUSED",
        "LIMIT_EXCEEDED",
        "UNSUPPORTED",
    }
)
DECODER_CODES = frozenset({"BAD_REQUEST", "FRAME_TOO_LARGE", "VERSION_MISMATCH"})
OK = "OK"
# the result key that counts what a transfer copied
MOVED = {
    "STORE": "stored",
    "RETRIEVE": "retrieved_tokens",
    "ENGINE_STORE": "stored",
    "ENGINE_RETRIEVE": "chunks",
}
UNDECIDED = "?"  # the reference decoder itself failed on the frame: any known refusal will do

# ----------------------------------------------------------------------- send, receive, check


@dataclasses.dataclass
class Expected:
    shot: Shot
    frame: bytes
    code: str | None  # the decoder's refusal; None: a valid request (ok or a request-level code)
    ping: bool = False

    def describe(self) -> str:
        return (
            f"{self.shot.kind} frame of {len(self.frame)} bytes, envelope {self.shot.envelope!r}:\n"
            f"  body  {self.shot.body!r:.600}\n  frame {self.frame[:4096].hex()}"
        )


def expectation(data: bytes) -> tuple[int, str | None]:
    """(request id, code) the reference decoder gives ``data``; `UNDECIDED` when the decoder
    fails here with anything but a kvwarden error (the server must still refuse the frame)."""
    raw: Any = None
    try:
        raw = unpack(data, MAX_FRAME)
        req = decode_request(raw)
    except KVWardenError as exc:
        return peek_request_id(raw), exc.code
    except Exception:  # e.g. RecursionError: what the server does with it is what is tested
        return peek_request_id(raw), UNDECIDED
    return req.request_id, None


class Fuzzer:
    """Sends batches over one DEALER socket and checks every reply (see the module docstring)."""

    def __init__(self, srv: ServerProcess) -> None:
        self.srv = srv
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock: zmq.Socket[Any] | None = None
        self.rids = itertools.count(1 << 40)
        self.codes: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()  # frames sent, by kind ("sweep:..." by field swept)
        self.ok_kinds: Counter[str] = Counter()  # ok replies to generated message frames, by kind
        self.moved: Counter[str] = Counter()  # chunks (tokens for RETRIEVE) copied, by type
        self.frames = 0  # fuzzed frames (not the set-up REGISTERs nor the PING probes)
        self.sent = 0  # every frame
        self.undecided = 0  # refused frames the reference decoder failed on here

    def new_socket(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
        self.sock = dealer(self.ctx, self.srv.endpoint)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
        self.ctx.term()

    def fire(self, batch: list[Shot]) -> None:
        """Send the batch back to back (then a PING probe) and check every reply; a failure
        leaves the socket unusable (stale replies may follow), so it is replaced."""
        try:
            self._fire(batch)
        except BaseException:
            self.new_socket()
            raise

    def _fire(self, batch: list[Shot]) -> None:
        assert self.sock is not None
        assert self.srv.proc.poll() is None, f"the server exited with {self.srv.proc.returncode}"
        pending: dict[int, Expected] = {}
        for shot in batch:
            data = shot.frame(next(self.rids))
            rid, code = expectation(data)
            if rid in pending:  # replies are matched by id: flush before reusing one
                self._collect(pending)
            self.sock.send_multipart([*shot.envelope, data])
            pending[rid] = Expected(shot, data, code)
            self.sent += 1
            self.frames += not shot.kind.startswith("setup")
            self.kinds[shot.kind] += 1
        probe_rid = next(self.rids)
        probe = encode_message(probe_rid, Ping(None, None))
        self.sock.send(probe)
        self.sent += 1
        pending[probe_rid] = Expected(Shot("probe", probe), probe, None, ping=True)
        self._collect(pending)

    def _collect(self, pending: dict[int, Expected]) -> None:
        assert self.sock is not None
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while pending:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                waiting = list(pending.values())  # in send order: the first is the likeliest culprit
                alive = self.srv.proc.poll() is None
                raise AssertionError(
                    f"no reply within {REPLY_TIMEOUT_S:g}s (server alive: {alive}) to {len(waiting)} "
                    f"frame(s), the first sent:\n{waiting[0].describe()}\n"
                    f"server log tail:\n{self.srv.output()[-3000:]}"
                )
            parts = self.sock.recv_multipart()
            reply = decode_reply(parts[-1])  # raises VersionMismatch on a reply of another version
            exp = pending.pop(reply.request_id, None)
            assert exp is not None, f"a reply to no pending request: {reply}"
            assert tuple(parts[:-1]) == exp.shot.envelope, (
                f"envelope not echoed: {parts[:-1]}\n{exp.describe()}"
            )
            try:
                self._check(reply.ok, reply.body, exp)
            except AssertionError:
                raise
            except Exception as exc:  # a reply of an unexpected shape: name the frame too
                raise AssertionError(f"reply {reply!r:.300}: {exc!r}\nto {exp.describe()}") from exc

    def _check(self, ok: bool, body: Any, exp: Expected) -> None:
        if ok:
            refused = exp.code
            assert refused is None, (
                f"ok reply {body!r:.300} to a frame refused ({refused}):\n{exp.describe()}"
            )
            assert isinstance(body, dict), body
            self.codes[OK] += 1
            if exp.shot.kind.startswith(("message:", "transfer:")):
                self.ok_kinds[exp.shot.kind] += 1
            mtype = exp.shot.kind.removeprefix("transfer:")  # a generated message may change type
            if mtype in MOVED:
                self.moved[mtype] += int(body[MOVED[mtype]])
            if exp.ping:
                assert isinstance(body["boot_token"], int) and body["tracked"] is None, body
            return
        assert isinstance(body, dict) and set(body) == {"code", "message"}, body
        code, message = body["code"], body["message"]
        assert code in KNOWN_CODES, f"error reply {code}: {message[:600]}\nto {exp.describe()}"
        if exp.ping:
            raise AssertionError(f"the PING probe failed: {code}: {message}")
        if exp.code is UNDECIDED:
            self.undecided += 1
        elif exp.code is not None:
            assert code == exp.code, f"{code} ({message[:300]}), expected {exp.code}:\n{exp.describe()}"
        else:
            assert code not in DECODER_CODES, (
                f"{code} ({message[:300]}) for a valid request:\n{exp.describe()}"
            )
        self.codes[code] += 1


def sweep(fuzzer: Fuzzer, geo: Geometry) -> None:
    """`sweep_shots`, in batches behind the set-up REGISTERs, on one socket."""
    setup = setup_shots(geo)
    fuzzer.new_socket()
    todo = sweep_shots(geo)
    for k in range(0, len(todo), 2 * MAX_BATCH):
        fuzzer.fire(setup)
        fuzzer.fire(todo[k : k + 2 * MAX_BATCH])


def fuzz(fuzzer: Fuzzer, geo: Geometry, target_frames: int) -> None:
    """Rounds of Hypothesis examples, each round on a new socket (the old connection's instances
    are reaped after the disconnect grace), until ``target_frames`` more frames were sent."""
    setup = setup_shots(geo)
    strategy = st.lists(shots(geo), min_size=1, max_size=MAX_BATCH)
    start = fuzzer.frames
    for round_no in itertools.count():
        if fuzzer.frames - start >= target_frames:
            return
        fuzzer.new_socket()

        @seed(round_no)
        @settings(
            max_examples=EXAMPLES_PER_ROUND,
            deadline=None,
            derandomize=True,
            database=None,
            # no shrinking: a failure names its frame, and a dead server fails every replay
            phases=(Phase.explicit, Phase.generate),
            suppress_health_check=list(HealthCheck),
        )
        @given(batch=strategy)
        def run(batch: list[Shot]) -> None:
            fuzzer.fire(setup)  # answered before the batch goes: its transfers find both instances
            fuzzer.fire(batch)

        run()


# ------------------------------------------------------------------------------------ tests


@pytest.fixture
def caches() -> Iterator[list[torch.Tensor]]:
    made = allocate_kv_caches(**LAYOUT)  # type: ignore[arg-type]
    yield made
    free_kv_caches(made)


@pytest.fixture
def server(caches: list[torch.Tensor], make_server: ServerFactory) -> ServerProcess:
    """Requested after ``caches``: stopped before they are freed."""
    return make_server(
        "--max-frame-bytes",
        str(MAX_FRAME),
        "--chunk-size",
        str(CHUNK),
        "--l1-size-gb",
        "0.01",
        "--max-pool-gb",
        "0.125",
        "--worker-disconnect-grace-seconds",
        "1",
    )


def _run(server: ServerProcess, caches: list[torch.Tensor], target: int) -> None:
    geo = geometry(caches)
    fuzzer = Fuzzer(server)
    t0 = time.monotonic()
    try:
        sweep(fuzzer, geo)
        swept = fuzzer.frames
        fuzz(fuzzer, geo, target)
    finally:
        fuzzer.close()
    elapsed = time.monotonic() - t0
    kinds = Counter({k: n for k, n in fuzzer.kinds.items() if not k.startswith("sweep:")})
    kinds["sweep"] = sum(n for k, n in fuzzer.kinds.items() if k.startswith("sweep:"))
    print(
        f"\nwire fuzz: {swept} swept + {fuzzer.frames - swept} generated frames "
        f"({fuzzer.sent} with set-up and probes) in "
        f"{elapsed:.1f}s; replies by code: {dict(fuzzer.codes)}; undecided: {fuzzer.undecided}; "
        f"frames by kind: {dict(sorted(kinds.items()))}; ok replies to generated requests: "
        f"{dict(sorted(fuzzer.ok_kinds.items()))}; copied: {dict(fuzzer.moved)}"
    )
    assert fuzzer.frames - swept >= target
    # the fuzz reached past the decoder: valid requests, refusals of each kind, ok transfers
    reached = {OK, "BAD_REQUEST", "FRAME_TOO_LARGE", "VERSION_MISMATCH", "NOT_REGISTERED", "NOT_OWNER"}
    reached |= {"INVALID_LAYOUT", "REQUEST_REFUSED"}
    assert reached <= set(fuzzer.codes), f"codes never seen: {reached - set(fuzzer.codes)}"
    # ... and the copy paths, both ways (which of the two modes copied in a direction depends on
    # what was generated: a chunk stored once is present, not copied, the next time)
    assert fuzzer.moved["STORE"] + fuzzer.moved["ENGINE_STORE"] > 0, fuzzer.moved
    assert fuzzer.moved["RETRIEVE"] + fuzzer.moved["ENGINE_RETRIEVE"] > 0, fuzzer.moved
    assert server.proc.poll() is None, f"the server exited with {server.proc.returncode}"
    ctx: zmq.Context[Any] = zmq.Context()
    sock = dealer(ctx, server.endpoint)
    try:
        ping(sock)
    finally:
        sock.close(linger=0)
        ctx.term()
    server.sigterm()
    rc = server.proc.wait(30)
    out = server.output()
    assert rc == 0, f"exit {rc} on SIGTERM:\n{out[-5000:]}"
    at = out.find("Traceback")
    assert at < 0, f"a traceback in the server's log:\n{out[max(0, at - 300) : at + 3000]}"


def test_wire_fuzz(server: ServerProcess, caches: list[torch.Tensor]) -> None:
    _run(server, caches, DEFAULT_FRAMES)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_wire_fuzz_soak(server: ServerProcess, caches: list[torch.Tensor]) -> None:
    _run(server, caches, SOAK_FRAMES)
