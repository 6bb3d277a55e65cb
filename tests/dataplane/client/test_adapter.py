"""The worker adapter's liveness side against real in-process servers on real sockets.

Servers come from `build_dataplane`; where a test must hold the server at one point (a REGISTER
in progress, a loop that cannot answer), it assembles the same modules itself and plugs a
gated module in at the server's module seam. `heartbeat_once` drives one PING and its
consequences without waiting for the thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import zmq

from dataplane.client import WorkerAdapter, allocate_kv_caches, free_kv_caches
from dataplane.liveness.release import InstanceReleaser
from dataplane.memory.shm import SHM_DIR
from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import Handler, RequestContext
from dataplane.modules.engine_pool import EngineDrivenTransferModule
from dataplane.modules.lookup import LookupModule
from dataplane.modules.management import ManagementModule
from dataplane.modules.server_driven import ServerDrivenTransferModule
from dataplane.server.config import Settings
from dataplane.server.loop import Server
from dataplane.server.runtime import DataPlane, build_dataplane
from dataplane.storage.l1 import L1Store
from dataplane.wire.errors import RequestError
from dataplane.wire.messages import MsgType, Register
from dataplane.wire.protocol import encode_request
from dataplane.wire.replies import Registered, Released
from tests.dataplane.registration import segment_of
from tests.helpers import free_port, wait_until

CHUNK = 16
# The heartbeat's PING timeout is its interval. One second, not less: the servers here run in
# this process and share its GIL and a (possibly busy, 2-core) CI machine with the test, so a
# shorter PING timeout would let a slow-but-alive server flap the adapter's health at random.
HB = 1.0
WAIT = 15.0  # for what the heartbeat thread does: a few HB periods, with room for a slow host
N_TOKENS = 64
SRC, DST = [0, 1, 2, 3], [8, 9, 10, 11]
Caches = list[torch.Tensor]


# -------------------------------------------------------------------------------- servers


@dataclass
class Assembled:
    """The data plane's modules on a server loop, with a transfer module of the test's choice."""

    server: Server
    management: ManagementModule
    transfer: ServerDrivenTransferModule

    def stop(self) -> None:
        assert self.server.stop(5.0)


class Servers:
    """Every server a test starts; all stopped at teardown."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self._running: list[DataPlane | Assembled] = []

    def dataplane(self) -> DataPlane:
        dp = build_dataplane(
            Settings(
                port=self.port,
                http_port=free_port(),
                chunk_size=CHUNK,
                l1_size_gb=0.01,
                worker_reap_timeout_seconds=0,
                worker_registration_grace_seconds=0,
                worker_disconnect_grace_seconds=0,
            )
        )
        dp.start()
        self._running.append(dp)
        return dp

    def assembled(
        self, transfer: ServerDrivenTransferModule | None = None, extra: Sequence[Any] = ()
    ) -> Assembled:
        """Wired as `build_dataplane` wires them (reaping off, as in ``dataplane``)."""
        metrics = DataPlaneMetrics()
        l1 = L1Store(16 << 20)
        server = Server(self.endpoint, metrics=metrics)
        info = server.info(CHUNK)
        sd = transfer or ServerDrivenTransferModule(l1, CHUNK, metrics)
        ed = EngineDrivenTransferModule(l1, CHUNK, metrics)
        releaser = InstanceReleaser([sd.registry, ed.registry], metrics)
        mgmt = ManagementModule(info, releaser, metrics)
        server.add_connection_listener(mgmt.on_connection)
        for m in (mgmt, sd, ed, *extra):
            server.add_module(m)
        if not any(MsgType.LOOKUP in m.handlers() for m in extra):
            server.add_module(LookupModule(l1, CHUNK, metrics, [sd.registry, ed.registry]))
        server.start()
        a = Assembled(server, mgmt, sd)
        self._running.append(a)
        return a

    def stop_all(self) -> None:
        for s in self._running:
            if isinstance(s, DataPlane):
                assert s.stop(5.0)
            else:
                s.stop()


class GatedRegister(ServerDrivenTransferModule):
    """REGISTER waits at ``gate`` (once ``entered`` is set) and refuses the first ``fail`` ones."""

    def __init__(self, fail: int = 0) -> None:
        super().__init__(L1Store(16 << 20), CHUNK, DataPlaneMetrics())
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.fail = fail
        self.attempts = 0

    def _register(self, rctx: RequestContext, reg: Register) -> Registered:
        self.attempts += 1
        self.entered.set()
        self.gate.wait(30)
        if self.attempts <= self.fail:
            raise RequestError("not now")
        return super()._register(rctx, reg)


class LoopBlocker:
    """A module whose ENGINE_RELEASE handler (a LOOP row of the protocol table) holds the socket
    loop until released: the server keeps all its state but answers nothing, as in a short
    network partition."""

    name = "loop-blocker"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.holding = threading.Event()

    def handlers(self) -> dict[MsgType, Handler]:
        return {MsgType.ENGINE_RELEASE: Handler(self._hold)}

    def _hold(self, rctx: RequestContext, payload: Any) -> Released:
        self.holding.set()
        self.release.wait(30)
        return Released(True)

    def start(self) -> None:
        return None

    def stop(self) -> None:
        self.release.set()

    def close(self) -> None:
        return None


@pytest.fixture(autouse=True)
def _no_kvwarden_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("KVWARDEN_"):
            monkeypatch.delenv(k)


@pytest.fixture
def servers() -> Iterator[Servers]:
    s = Servers()
    yield s
    s.stop_all()


@pytest.fixture
def adapters() -> Iterator[Callable[..., WorkerAdapter]]:
    made: list[WorkerAdapter] = []

    def make(endpoint: str, **kw: Any) -> WorkerAdapter:
        kw.setdefault("model_name", "hb")
        kw.setdefault("request_timeout", 10.0)
        w = WorkerAdapter(endpoint, **kw)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


@pytest.fixture
def caches() -> Iterator[Caches]:
    c = allocate_kv_caches(2, 16, 16, 2, 8, torch.bfloat16)
    yield c
    free_kv_caches(c)  # a no-op for segments close() unlinked already


def heartbeat_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "kvwarden-heartbeat" and t.is_alive())


def tokens_and_data(seed: int) -> tuple[list[int], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (N_TOKENS,), generator=g).tolist()
    data = [torch.randn((2, 4, 16, 2, 8), generator=g).to(torch.bfloat16) for _ in range(2)]
    return tokens, data


def round_trip(w: WorkerAdapter, caches: Caches, seed: int) -> None:
    """Store a pattern, wipe the destination blocks, retrieve: byte-equal."""
    tokens, data = tokens_and_data(seed)
    for layer, d in zip(caches, data, strict=True):
        layer[:, SRC] = d
    assert w.store(tokens, SRC)
    for layer in caches:
        layer[:, DST] = 0
    assert w.retrieve(tokens, DST) == N_TOKENS
    for layer, d in zip(caches, data, strict=True):
        assert torch.equal(layer[:, DST].view(torch.int16), d.view(torch.int16))


def tracked(s: DataPlane | Assembled, instance_id: int) -> bool:
    return s.transfer.registry.context_entry(instance_id) is not None


# ---------------------------------------------------------------------------------- tests


def test_heartbeat_starts_at_registration(
    servers: Servers, adapters: Callable[..., WorkerAdapter], caches: Caches
) -> None:
    dp = servers.dataplane()
    w = adapters(servers.endpoint, heartbeat_interval=HB)
    before = heartbeat_threads()
    w.server_info()
    assert heartbeat_threads() == before  # not before there is something to keep alive
    w.register_kv_caches(caches)
    assert heartbeat_threads() == before + 1  # right away, not on the first transfer
    # idle: no transfer at all, yet the instance is ping-proven
    wait_until(
        lambda: (
            (e := dp.transfer.registry.context_entry(w.instance_id)) is not None and e.has_liveness_signal
        ),
        WAIT,
        what="a heartbeat PING",
    )
    w.close()
    assert heartbeat_threads() == before
    assert not tracked(dp, w.instance_id)  # close() unregistered


def test_health_starts_healthy_even_before_any_ping(adapters: Callable[..., WorkerAdapter]) -> None:
    nobody = f"tcp://127.0.0.1:{free_port()}"
    w = adapters(nobody, heartbeat_interval=HB)
    assert w.is_healthy is True


def test_unhealthy_adapter_answers_at_once_without_the_server(
    servers: Servers, adapters: Callable[..., WorkerAdapter], caches: Caches, monkeypatch: pytest.MonkeyPatch
) -> None:
    dp = servers.dataplane()
    changes: list[bool] = []
    w = adapters(
        servers.endpoint, heartbeat_interval=HB, request_timeout=30.0, on_health_change=changes.append
    )
    w.register_kv_caches(caches)
    round_trip(w, caches, 1)
    assert dp.stop(5.0)
    wait_until(lambda: not w.is_healthy, WAIT, what="the adapter to turn unhealthy")
    assert changes == [False]
    tokens, _ = tokens_and_data(1)
    # A request that went out would block for its 30 s request_timeout (no connection: the
    # send waits for one) and then raise: none goes out, each is answered as a counted miss
    sent: list[str] = []
    request = w._chan.request

    def spy(msg: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(str(msg.TYPE))
        return request(msg, *args, **kwargs)

    monkeypatch.setattr(w._chan, "request", spy)
    misses = w.misses
    assert w.store(tokens, SRC) is False
    assert w.store_detail(tokens, SRC).stored == 0
    assert w.retrieve(tokens, DST) == 0
    assert w.lookup(tokens) == 0
    assert sent == [] and w.misses == misses + 4, (sent, w.misses - misses)
    servers.dataplane()  # back (a new server): the adapter recovers and closes promptly
    wait_until(lambda: w.is_healthy, WAIT, what="recovery")
    assert changes == [False, True]


def test_recover_runs_before_health_is_set(
    servers: Servers, adapters: Callable[..., WorkerAdapter], caches: Caches
) -> None:
    dp = servers.dataplane()
    at_change: list[tuple[bool, int]] = []
    gated = GatedRegister()

    def on_change(healthy: bool) -> None:  # what the server held when health changed
        at_change.append((healthy, gated.registry.tracked_instance_count()))

    w = adapters(servers.endpoint, heartbeat_interval=HB, on_health_change=on_change)
    w.register_kv_caches(caches)
    assert dp.stop(5.0)
    wait_until(lambda: not w.is_healthy, WAIT, what="unhealthy")
    s2 = servers.assembled(gated)  # a new server (new boot token) whose REGISTER we hold
    assert gated.entered.wait(10), "the adapter never re-registered"
    hold_until = time.monotonic() + 0.5
    tick = threading.Event()
    while time.monotonic() < hold_until:  # PINGs succeed meanwhile, but recovery is not done
        assert not w.is_healthy, "healthy before the re-registration finished"
        tick.wait(0.02)
    gated.gate.set()
    wait_until(lambda: w.is_healthy, WAIT, what="healthy after the re-registration")
    assert at_change == [(False, 0), (True, 1)]
    assert w.registrations == 2 and tracked(s2, w.instance_id)
    assert w.refreshes == 0  # the new server built a fresh context: no refresh
    round_trip(w, caches, 2)


def test_failed_recovery_leaves_health_clear_and_is_retried(
    servers: Servers, adapters: Callable[..., WorkerAdapter], caches: Caches
) -> None:
    dp = servers.dataplane()
    changes: list[bool] = []
    w = adapters(servers.endpoint, heartbeat_interval=HB, on_health_change=changes.append)
    w.register_kv_caches(caches)
    assert dp.stop(5.0)
    wait_until(lambda: not w.is_healthy, WAIT, what="unhealthy")
    gated = GatedRegister(fail=2)
    gated.gate.set()
    s2 = servers.assembled(gated)
    wait_until(lambda: w.is_healthy, 2 * WAIT, what="recovery after two refused REGISTERs")
    assert gated.attempts == 3
    assert changes == [False, True]  # never flapped to healthy while REGISTER was refused
    assert w.registrations == 2 and tracked(s2, w.instance_id)
    assert w.refreshes == 0  # a refused REGISTER counts as neither


def test_restart_between_two_pings_is_noticed_by_the_boot_token(
    servers: Servers, adapters: Callable[..., WorkerAdapter], caches: Caches
) -> None:
    old = servers.dataplane()
    changes: list[bool] = []
    w = adapters(servers.endpoint, heartbeat_interval=5.0, on_health_change=changes.append)
    w.register_kv_caches(caches)
    round_trip(w, caches, 1)
    assert w.boot_token == old.server.boot_token
    assert old.stop(5.0)
    new = servers.dataplane()  # same port, at once
    assert new.server.boot_token != old.server.boot_token
    w.heartbeat_once()  # this PING succeeds: only the token tells
    assert w.registrations == 2 and w.boot_token == new.server.boot_token
    assert tracked(new, w.instance_id) and new.transfer.registry.tracked_instance_count() == 1
    assert changes == [] and w.is_healthy
    tokens, _ = tokens_and_data(1)
    assert w.retrieve(tokens, DST) == 0  # the old server's L1 is gone
    round_trip(w, caches, 1)
    w.heartbeat_once()
    assert w.registrations == 2 and w.refreshes == 0  # a healthy, tracked PING sends no REGISTER


def test_short_outage_recovers_with_a_no_op_reregister(
    servers: Servers, adapters: Callable[..., WorkerAdapter], caches: Caches
) -> None:
    blocker = LoopBlocker()
    s = servers.assembled(extra=[blocker])
    changes: list[bool] = []
    w = adapters(servers.endpoint, heartbeat_interval=HB, on_health_change=changes.append)
    w.register_kv_caches(caches)
    assert (w.registrations, w.refreshes) == (1, 0)
    registered_at = s.transfer.registry.context_entry(w.instance_id).registered_at  # type: ignore[union-attr]
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(servers.endpoint)
    try:
        sock.send(encode_request(1, MsgType.ENGINE_RELEASE, [w.instance_id, bytes(16), 1]))
        assert blocker.holding.wait(5)
        wait_until(lambda: not w.is_healthy, WAIT, what="unhealthy while the server is silent")
        blocker.release.set()
        wait_until(lambda: w.is_healthy, WAIT, what="healthy again")
    finally:
        sock.close(linger=0)
        ctx.term()
    assert changes == [False, True]
    # exactly one REGISTER went out, and the server, which still had it, answered created:
    # false: a refresh, nothing rebuilt
    assert (w.registrations, w.refreshes) == (1, 1)
    e = s.transfer.registry.context_entry(w.instance_id)
    assert e is not None and e.registered_at == registered_at
    assert s.transfer.registry.tracked_instance_count() == 1


def test_reaped_instance_reregisters_exactly_once(
    servers: Servers, adapters: Callable[..., WorkerAdapter], caches: Caches
) -> None:
    dp = servers.dataplane()
    w = adapters(servers.endpoint, heartbeat_interval=5.0)
    w.register_kv_caches(caches)
    assert dp.management.force_reap(w.instance_id) == ["server_driven"]
    w.heartbeat_once()
    assert w.registrations == 2 and tracked(dp, w.instance_id)
    assert dp.transfer.registry.tracked_instance_count() == 1
    w.heartbeat_once()
    assert (w.registrations, w.refreshes) == (2, 0)  # the second PING sent no REGISTER at all
    round_trip(w, caches, 3)


def test_engine_driven_adapter_rebuilds_its_pool_after_a_reap(
    servers: Servers, adapters: Callable[..., WorkerAdapter], caches: Caches
) -> None:
    dp = servers.dataplane()
    w = adapters(servers.endpoint, heartbeat_interval=5.0, transfer_mode="engine_driven")
    w.register_kv_caches(caches)
    round_trip(w, caches, 4)
    assert dp.management.force_reap(w.instance_id) == ["engine_driven"]
    assert dp.engine.registry.tracked_instance_count() == 0 and dp.engine.pool_budget.used == 0
    w.heartbeat_once()
    assert (w.registrations, w.refreshes) == (2, 0)
    assert dp.engine.registry.tracked_instance_count() == 1 and dp.engine.pool_budget.used > 0
    round_trip(w, caches, 5)
    round_trip(w, caches, 4)


def test_no_ghost_registration_after_close(
    servers: Servers, adapters: Callable[..., WorkerAdapter], caches: Caches
) -> None:
    dp = servers.dataplane()
    w = adapters(servers.endpoint, heartbeat_interval=5.0)
    before = heartbeat_threads()
    w.register_kv_caches(caches)
    assert heartbeat_threads() == before + 1
    dp.management.force_reap(w.instance_id)  # a PING now would re-register ...
    w.close()
    assert heartbeat_threads() == before
    w.heartbeat_once()  # ... but not after close()
    assert (w.registrations, w.refreshes) == (1, 0)
    assert dp.transfer.registry.tracked_instance_count() == 0


def test_start_up_warning_when_three_heartbeats_exceed_the_floor(
    adapters: Callable[..., WorkerAdapter], caplog: pytest.LogCaptureFixture
) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING, "dataplane.client"):
        adapters(endpoint, heartbeat_interval=10.0)  # 3 x 10 = 30: at the floor, fine
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        adapters(endpoint, heartbeat_interval=10.5)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "heartbeat_interval" in warnings[0] and "31.5" in warnings[0] and "30" in warnings[0]


def test_instance_ids_are_random_63_bit_and_logged(
    adapters: Callable[..., WorkerAdapter], caplog: pytest.LogCaptureFixture
) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.INFO, "dataplane.client"):
        ids = [adapters(endpoint, heartbeat_interval=1.0).instance_id for _ in range(4)]
    assert len(set(ids)) == 4
    assert all(0 <= i < 1 << 63 and i != os.getpid() for i in ids)
    for i in ids:
        assert f"instance id {i} " in caplog.text


def test_free_kv_caches_after_close_is_a_no_op(
    servers: Servers, adapters: Callable[..., WorkerAdapter], make_caches: Callable[[], Caches]
) -> None:
    servers.dataplane()
    c = allocate_kv_caches(2, 16, 16, 2, 8, torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    for layer in c:
        layer.copy_(torch.randn(layer.shape, generator=g).to(layer.dtype))
    pattern = [layer.clone() for layer in c]
    bystander = segment_of(make_caches())  # another live cache set of this process
    w = adapters(servers.endpoint, heartbeat_interval=5.0)
    w.register_kv_caches(c)
    names = w.segments
    assert names == [segment_of(c)] and (SHM_DIR / names[0]).exists()
    w.close()  # unlinks the segments it registered
    assert not any((SHM_DIR / n).exists() for n in names)
    free_kv_caches(c)  # the documented way to free caches must not fail because of that
    free_kv_caches(c)  # nor when called twice
    assert not any((SHM_DIR / n).exists() for n in names)
    assert (SHM_DIR / bystander).exists()  # it unlinked nothing else
    # "mappings stay valid until the tensors die": the bytes are still there, and writable
    for layer, p in zip(c, pattern, strict=True):
        assert torch.equal(layer.view(torch.int16), p.view(torch.int16))
    c[1][1, 15] = 3.0
    assert bool((c[1][1, 15] == 3.0).all())
    assert torch.equal(c[0].view(torch.int16), pattern[0].view(torch.int16))
