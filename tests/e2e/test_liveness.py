"""Worker liveness end to end: real worker processes, real servers, real sockets and memory.

Workers are `tests/e2e/liveness_worker.py` processes driven over stdin/stdout. Servers are either
`kvwarden serve` processes (started from a standby process so a restart on the same port takes
a fraction of a second) or, where the reap window must be shorter than the 30 s floor of the
settings, a server assembled in this process with a short-timeout reaper. Nothing waits for a
fixed time: every wait polls a condition until a deadline.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import msgpack
import pytest
import zmq

from dataplane.memory.shm import SHM_DIR, unlink_if_owner_gone
from dataplane.server.config import Settings
from dataplane.server.runtime import DataPlane, build_dataplane
from dataplane.wire.messages import MsgType
from dataplane.wire.protocol import PROTOCOL_VERSION, decode_reply, encode_request
from tests.helpers import ROOT, free_port, subprocess_env, wait_until

WORKER = Path(__file__).resolve().parent / "liveness_worker.py"
CHUNK = 16
N_TOKENS = 64
Event = dict[str, Any]


# ----------------------------------------------------------------------------- processes


class Proc:
    """A child process printing JSON lines; a reader thread records each with its arrival time."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.log_path = log_path
        self._log: IO[bytes] = open(log_path, "wb")  # noqa: SIM115  (closed in stop())
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), *args],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=subprocess_env(),
        )
        self.pid = self.proc.pid
        self.events: list[tuple[float, Event]] = []
        self._eof = False
        self._cond = threading.Condition()  # guards events and _eof
        self._reader = threading.Thread(target=self._read, name=f"reader-{self.pid}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            t = time.monotonic()
            try:
                ev = json.loads(raw)
            except ValueError:
                ev = None
            if not isinstance(ev, dict):
                ev = {"event": "text", "text": raw.decode(errors="replace").rstrip()}
            with self._cond:
                self.events.append((t, ev))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def wait_for(
        self, pred: Callable[[Event], bool], timeout: float, since: int = 0, what: str = "event"
    ) -> tuple[int, float, Event]:
        """The first event from index ``since`` on that matches: (next index, arrival, event)."""
        deadline = time.monotonic() + timeout
        i = since
        with self._cond:
            while True:
                while i < len(self.events):
                    t, ev = self.events[i]
                    i += 1
                    if pred(ev):
                        return i, t, ev
                left = deadline - time.monotonic()
                if left <= 0 or self._eof:
                    raise AssertionError(
                        f"pid {self.pid}: no {what} within {timeout:g}s (eof={self._eof}); "
                        f"events: {[e for _, e in self.events][-20:]}\nlog:\n{self.log()[-3000:]}"
                    )
                self._cond.wait(left)

    def cursor(self) -> int:
        with self._cond:
            return len(self.events)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((line + "\n").encode())
        self.proc.stdin.flush()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: signal.Signals) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGCONT)  # a stopped process would not act on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()
        self._reader.join(5)
        self._log.close()


class Worker(Proc):
    def __init__(
        self,
        endpoint: str,
        log_dir: Path,
        heartbeat: float,
        model: str = "liveness",
        mode: str = "server_driven",
    ) -> None:
        super().__init__(
            [endpoint, "--heartbeat", str(heartbeat), "--model", model, "--mode", mode],
            log_dir / f"worker-{model}.log",
        )
        self.heartbeat = heartbeat
        self.instance_id = -1
        self.segments: list[str] = []

    def wait_registered(self, timeout: float = 60.0) -> None:
        _, _, ev = self.wait_for(lambda e: e["event"] == "registered", timeout, what="registration")
        self.instance_id = int(ev["instance_id"])
        self.segments = list(ev["segments"])
        assert self.segments, ev
        self.wait_for(
            lambda e: e == {"event": "state", "registrations": 1, "refreshes": 0, "healthy": True},
            10,
            what="initial state",
        )

    def _command(self, cmd: str, kind: str, timeout: float) -> tuple[float, Event]:
        since = self.cursor()
        t0 = time.monotonic()
        self.send(cmd)
        _, t, ev = self.wait_for(lambda e: e["event"] == kind, timeout, since, what=kind)
        return t - t0, ev

    def store(self, seed: int, timeout: float = 15.0) -> bool:
        return bool(self._command(f"store {seed}", "store", timeout)[1]["ok"])

    def retrieve(self, seed: int, timeout: float = 15.0) -> tuple[int, bool, float]:
        took, ev = self._command(f"retrieve {seed}", "retrieve", timeout)
        return int(ev["tokens"]), bool(ev["equal"]), took

    def states(self) -> list[Event]:
        return [e for _, e in list(self.events) if e["event"] == "state"]

    def quit(self) -> None:
        since = self.cursor()
        self.send("quit")
        self.wait_for(lambda e: e["event"] == "closed", 15, since, what="close")
        assert self.proc.wait(15) == 0


class CliServer(Proc):
    """`kvwarden serve` from a standby process: ``go()`` starts serving in a fraction of a second."""

    def __init__(self, log_dir: Path, port: int, *flags: str) -> None:
        self.port = port
        self.endpoint = f"tcp://127.0.0.1:{port}"
        args = [
            "--serve-on-go",
            "--port",
            str(port),
            "--http-port",
            str(free_port()),
            "--chunk-size",
            str(CHUNK),
            "--l1-size-gb",
            "0.01",
            "--log-level",
            "info",
            *flags,
        ]
        super().__init__(args, log_dir / f"server-{port}-{time.monotonic_ns()}.log")

    def wait_standby(self, timeout: float = 60.0) -> None:
        self.wait_for(lambda e: e["event"] == "standby", timeout, what="standby")

    def go(self, timeout: float = 30.0) -> float:
        """Start serving; returns the monotonic time the first HELLO was answered."""
        self.send("go")
        return hello_ready(self.endpoint, timeout, self)

    def start(self) -> float:
        self.wait_standby()
        return self.go()

    def log_has(self, text: str) -> bool:
        return text in self.log()


def hello_ready(endpoint: str, timeout: float, proc: Proc | None = None) -> float:
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(encode_request(1, MsgType.HELLO, []))
        deadline = time.monotonic() + timeout
        while not sock.poll(20, zmq.POLLIN):
            if proc is not None and proc.proc.poll() is not None:
                raise AssertionError(f"server exited {proc.proc.returncode}:\n{proc.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no HELLO reply from {endpoint} within {timeout:g}s")
        reply = decode_reply(sock.recv())
        assert reply.ok, reply
        return time.monotonic()
    finally:
        sock.close(linger=0)
        ctx.term()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[list[Proc]]:
    """Every process a test starts; all are stopped (continued first, if stopped) at teardown."""
    started: list[Proc] = []
    yield started
    for p in started:
        p.stop()
    for p in started:  # segments of workers that were killed and never reaped
        for path in SHM_DIR.glob(f"kvwarden-{p.pid}-*"):
            unlink_if_owner_gone(path.name)


def spawn_workers(
    procs: list[Proc], endpoint: str, log_dir: Path, heartbeat: float, models: list[str]
) -> list[Worker]:
    ws = [Worker(endpoint, log_dir, heartbeat, model=m) for m in models]
    procs.extend(ws)
    return ws


def start_workers(
    procs: list[Proc], endpoint: str, log_dir: Path, heartbeat: float, models: list[str]
) -> list[Worker]:
    ws = spawn_workers(procs, endpoint, log_dir, heartbeat, models)
    for w in ws:
        w.wait_registered()
    return ws


def start_cli_with_workers(
    procs: list[Proc], log_dir: Path, heartbeat: float, models: list[str], *flags: str
) -> tuple[CliServer, list[Worker]]:
    """Server and workers start side by side (a worker waits for the server to answer)."""
    srv = CliServer(log_dir, free_port(), *flags)
    procs.append(srv)
    ws = spawn_workers(procs, srv.endpoint, log_dir, heartbeat, models)
    srv.start()
    for w in ws:
        w.wait_registered()
    return srv, ws


# ------------------------------------------------------------------ in-process server


@dataclass
class InProcess:
    dp: DataPlane

    @property
    def endpoint(self) -> str:
        return self.dp.server_info().endpoint

    @property
    def reaped_total(self) -> int:
        return self.dp.management.releaser.reaped_total

    def tracked(self, instance_id: int) -> bool:
        return self.dp.transfer.registry.context_entry(instance_id) is not None


@pytest.fixture
def in_process() -> Iterator[Callable[..., InProcess]]:
    """A real data plane in this process whose reaper runs with a timeout below the floor (its
    settings are built without the floor's validation: the floor protects users, not tests)."""
    made: list[DataPlane] = []

    def make(reap_timeout_s: float, grace_s: float, disconnect_grace_s: float = 0.0) -> InProcess:
        settings = Settings.model_construct(
            port=free_port(),
            chunk_size=CHUNK,
            l1_size_gb=16 / 1024,
            worker_reap_timeout_seconds=reap_timeout_s,
            worker_registration_grace_seconds=grace_s,
            worker_disconnect_grace_seconds=disconnect_grace_s,
        )
        dp = build_dataplane(settings)
        made.append(dp)
        dp.start()
        return InProcess(dp)

    yield make
    for dp in made:
        assert dp.stop(5.0)


# ------------------------------------------------------------------------ observations


def mapped(pid: int | str, segment: str) -> bool:
    return segment in Path(f"/proc/{pid}/maps").read_text()


def shm_of(pid: int) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"kvwarden-{pid}-*"))


def poll_time(pred: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll until ``pred`` holds; returns the monotonic time it was first seen to hold."""
    wait_until(pred, timeout, interval=0.01, what=what)
    return time.monotonic()


def reaped_by(dp: InProcess, reason: str) -> float | None:
    """Reaps counted under ``reason`` (``kvwarden_instances_reaped_total``)."""
    return dp.dp.metrics.registry.get_sample_value("kvwarden_instances_reaped_total", {"reason": reason})


def silent_reaps(dp: InProcess) -> float:
    """Reaps for silence: past the reap timeout, or past the registration grace."""
    return sum(reaped_by(dp, r) or 0.0 for r in ("timeout", "grace"))


def works(w: Worker, seed: int) -> None:
    assert w.store(seed), f"store {seed} failed"
    tokens, equal, _ = w.retrieve(seed)
    assert (tokens, equal) == (N_TOKENS, True)


# ------------------------------------------------------------------------------ tests


def test_sigkilled_worker_is_reaped_within_the_disconnect_grace(procs: list[Proc], tmp_path: Path) -> None:
    grace = 2.0
    srv, (victim, other) = start_cli_with_workers(
        procs,
        tmp_path,
        0.3,
        ["victim", "other"],
        "--worker-reap-timeout-seconds",
        "30",
        "--worker-disconnect-grace-seconds",
        str(grace),
    )
    works(victim, 1)
    works(other, 2)
    seg = victim.segments[0]
    assert mapped(srv.pid, seg) and shm_of(victim.pid) == victim.segments

    t_kill = time.monotonic()
    victim.signal(signal.SIGKILL)
    victim.proc.wait(10)
    # reaped for its closed connection once the grace had passed on the server's clock (the
    # reason it logs; the 30 s silence timeout would say "timeout")
    line = f"reaper: reaped instance {victim.instance_id} (disconnect;"
    t_reap = poll_time(lambda: srv.log_has(line), grace + 10, "the disconnect reap")
    print(f"\nreaped {t_reap - t_kill:.2f}s after SIGKILL (disconnect grace {grace:g}s)")
    assert f"reaper: reaped instance {victim.instance_id} (timeout;" not in srv.log()
    wait_until(lambda: not mapped(srv.pid, seg), 2, what="the server unmapping the segment")
    wait_until(lambda: not shm_of(victim.pid), 2, what="the dead worker's segment unlinked")
    assert srv.log().count(f"registered instance {victim.instance_id} ") == 1

    works(other, 3)  # the other worker never noticed
    tokens, equal, _ = other.retrieve(2)
    assert (tokens, equal) == (N_TOKENS, True)
    assert mapped(srv.pid, other.segments[0])
    assert other.states()[-1] == {"event": "state", "registrations": 1, "refreshes": 0, "healthy": True}
    other.quit()


def test_sigkilled_worker_is_reaped_by_timeout_with_disconnect_detection_off(
    procs: list[Proc], tmp_path: Path, in_process: Callable[..., InProcess]
) -> None:
    timeout, heartbeat = 2.0, 0.4
    dp = in_process(timeout, timeout, disconnect_grace_s=0.0)
    victim, other = start_workers(procs, dp.endpoint, tmp_path, heartbeat, ["victim", "other"])
    works(victim, 1)
    works(other, 2)
    seg = victim.segments[0]
    assert mapped("self", seg)

    t_kill = time.monotonic()
    victim.signal(signal.SIGKILL)
    victim.proc.wait(10)
    t_reap = poll_time(lambda: not dp.tracked(victim.instance_id), 1.25 * timeout + 10, "the timeout reap")
    took = t_reap - t_kill
    print(f"\nreaped {took:.2f}s after SIGKILL (timeout {timeout:g}s, disconnect detection off)")
    # silent past the window (never before it ran out: the server's clock decided; "timeout"
    # once it pinged, "grace" if it died before its first PING: both windows are ``timeout``
    # here), not for its closed connection (detection is off); counted after the release path
    wait_until(lambda: silent_reaps(dp) == 1, 10, what="the reap counted")
    assert reaped_by(dp, "disconnect") == 0
    wait_until(lambda: not mapped("self", seg), 2, what="the server unmapping the segment")
    wait_until(lambda: not shm_of(victim.pid), 2, what="the dead worker's segment unlinked")
    assert dp.dp.liveness_status().reaped_total == 1

    assert dp.tracked(other.instance_id)
    works(other, 3)
    assert other.retrieve(2)[:2] == (N_TOKENS, True)
    assert other.states()[-1] == {"event": "state", "registrations": 1, "refreshes": 0, "healthy": True}
    other.quit()


def test_idle_worker_outlives_the_grace_on_its_heartbeat(
    procs: list[Proc], tmp_path: Path, in_process: Callable[..., InProcess]
) -> None:
    window = 1.5
    dp = in_process(window, window)
    (w,) = start_workers(procs, dp.endpoint, tmp_path, 0.3, ["idle"])
    deadline = time.monotonic() + 2 * window
    tick = threading.Event()
    while time.monotonic() < deadline:  # idle for two windows; it must stay tracked throughout
        entry = dp.dp.transfer.registry.context_entry(w.instance_id)
        assert entry is not None, "a live idle worker was reaped"
        tick.wait(0.05)
    assert entry.has_liveness_signal  # its own heartbeat, not traffic, kept it
    assert dp.reaped_total == 0
    assert [s["registrations"] for s in w.states()] == [1]
    works(w, 1)
    w.quit()
    assert not dp.tracked(w.instance_id)  # clean exit: UNREGISTER


def test_server_paused_shorter_than_the_window_costs_a_no_op_reregister(
    procs: list[Proc], tmp_path: Path
) -> None:
    srv, (w,) = start_cli_with_workers(
        procs,
        tmp_path,
        0.3,
        ["paused"],
        "--worker-reap-timeout-seconds",
        "30",
        "--worker-disconnect-grace-seconds",
        "10",
    )
    works(w, 1)

    since = w.cursor()
    t_stop = time.monotonic()
    srv.signal(signal.SIGSTOP)
    w.wait_for(lambda e: e["event"] == "state" and not e["healthy"], 5, since, what="unhealthy")
    # while unhealthy a retrieve reports a miss at once instead of waiting on the dead server:
    # the first miss of the outage logs why, and it is the unhealthy answer, no request sent
    tokens, _, _ = w.retrieve(1, timeout=8)
    assert tokens == 0
    assert "transfers answer as misses until the server is back (the server is unhealthy)" in w.log(), w.log()
    assert not w.store(2, timeout=8)
    wait_until(lambda: time.monotonic() - t_stop >= 1.5, 5, what="1.5 s of pause")
    srv.signal(signal.SIGCONT)

    w.wait_for(lambda e: e["event"] == "state" and e["healthy"], 10, since, what="recovery")
    assert all(s["registrations"] == 1 for s in w.states()), w.states()
    # exactly one REGISTER went out on recovery, and the server answered it as a refresh
    assert w.states()[-1]["refreshes"] == 1, w.states()
    assert srv.log().count(f"registered instance {w.instance_id} ") == 1  # nothing rebuilt
    assert "reaper: reaped" not in srv.log()
    tokens, equal, _ = w.retrieve(1)  # the data stored before the pause is still served
    assert (tokens, equal) == (N_TOKENS, True)
    w.quit()


def test_server_restart_between_pings_is_noticed_by_boot_token(procs: list[Proc], tmp_path: Path) -> None:
    heartbeat = 1.0
    old, (w,) = start_cli_with_workers(procs, tmp_path, heartbeat, ["restart"])
    new = CliServer(tmp_path, old.port)  # a standby on the same port, started at once below
    procs.append(new)
    works(w, 1)
    seg = w.segments[0]
    new.wait_standby()

    since = w.cursor()
    old.signal(signal.SIGKILL)
    old.proc.wait(10)
    t_ready = new.go()
    _, t_rereg, _ = w.wait_for(
        lambda e: e["event"] == "state" and e["registrations"] == 2,
        heartbeat + 5,
        since,
        what="re-registration",
    )
    took = t_rereg - t_ready
    went_unhealthy = any(not e["healthy"] for e in w.states())
    print(
        f"\nre-registered {took:.2f}s after the restarted server answered "
        f"(heartbeat {heartbeat:g}s; a PING failed meanwhile: {went_unhealthy})"
    )
    # the first PING the new server answered re-registered it: its boot token differed
    assert re.search(r"server restarted \(boot token \d+ -> \d+\): re-registering", w.log()), w.log()
    w.wait_for(lambda e: e["event"] == "state" and e["healthy"], 5, since, what="healthy")
    assert new.log().count(f"registered instance {w.instance_id} ") == 1
    assert mapped(new.pid, seg)  # the new server maps the same worker memory ...
    assert shm_of(w.pid) == w.segments  # ... which its start-up sweep left alone
    assert w.retrieve(1)[0] == 0  # the old server's L1 died with it
    works(w, 2)
    works(w, 1)
    assert w.states()[-1]["registrations"] == 2
    w.quit()


def test_worker_silent_past_the_window_is_reaped_then_reregisters_once(
    procs: list[Proc], tmp_path: Path, in_process: Callable[..., InProcess]
) -> None:
    window, heartbeat = 1.5, 0.3
    dp = in_process(window, window)
    (w,) = start_workers(procs, dp.endpoint, tmp_path, heartbeat, ["silent"])
    works(w, 1)
    seg = w.segments[0]

    since = w.cursor()
    w.signal(signal.SIGSTOP)
    poll_time(lambda: not dp.tracked(w.instance_id), 1.25 * window + 10, "the reap")
    # silent past the window, on the server's clock ("timeout" or "grace": both windows are
    # ``window`` here), counted once the release path is through
    wait_until(lambda: silent_reaps(dp) == 1, 10, what="the reap counted")
    assert reaped_by(dp, "disconnect") == 0
    wait_until(lambda: not mapped("self", seg), 2, what="the server unmapping the segment")
    assert shm_of(w.pid) == w.segments  # its owner lives (stopped): the segment stays
    w.signal(signal.SIGCONT)

    w.wait_for(
        lambda e: e["event"] == "state" and e["registrations"] == 2 and e["healthy"],
        heartbeat + 5,
        since,
        what="the re-registration",
    )
    assert dp.tracked(w.instance_id) and mapped("self", seg)
    assert dp.dp.transfer.registry.tracked_instance_count() == 1
    stable_until = time.monotonic() + 4 * heartbeat  # several more PINGs: no second rebuild
    wait_until(lambda: time.monotonic() >= stable_until, 5 * heartbeat, what="a few heartbeats")
    assert max(s["registrations"] for s in w.states()) == 2
    assert dp.reaped_total == 1
    tokens, equal, _ = w.retrieve(1)  # L1 keys by layout, not by context: still there
    assert (tokens, equal) == (N_TOKENS, True)
    works(w, 2)
    w.quit()


def test_other_protocol_version_gets_an_immediate_error_naming_both(
    in_process: Callable[..., InProcess],
) -> None:
    dp = in_process(60.0, 60.0)
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(dp.endpoint)
    try:
        sock.send(msgpack.packb([99, 4242, "PING", [None]], use_bin_type=True))
        assert sock.poll(10_000, zmq.POLLIN), "no reply to a v99 request"
        reply = decode_reply(sock.recv())
        # an error reply of its own (not a timeout, not a dropped frame), naming both versions
        assert (reply.ok, reply.request_id) == (False, 4242)
        assert reply.body["code"] == "VERSION_MISMATCH"
        assert "v99" in reply.body["message"] and f"v{PROTOCOL_VERSION}" in reply.body["message"]
        sock.send(encode_request(4243, MsgType.PING, [None, None]))  # the connection still works
        assert sock.poll(2000, zmq.POLLIN)
        ok = decode_reply(sock.recv())
        assert ok.ok and ok.request_id == 4243
    finally:
        sock.close(linger=0)
        ctx.term()
