"""``WorkerAdapter``: a worker's connection to the kvwarden server.

    caches = allocate_kv_caches(num_layers=32, num_blocks=1024, block_size=16,
                                num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    w = WorkerAdapter("tcp://127.0.0.1:5555", model_name="m", world_size=1, worker_id=0)
    w.register_kv_caches(caches); w.store(token_ids, block_ids); w.lookup(token_ids)
    w.retrieve(token_ids, block_ids); w.close()

Every request has a timeout; an error reply raises the typed exception of
`dataplane.wire.errors`. Requests go over one channel (`dataplane.client.channel`); the
heartbeat (`dataplane.client.heartbeat`), started at registration, PINGs over its own, so a long
transfer never delays it. The transport (`dataplane.client.transport`) moves the KV bytes.

Nothing waits on a dead server. While the heartbeat says the server is unhealthy, stores are
dropped and lookups and retrieves report a miss, without waiting. A transfer whose connection
closes ends at once; one made with no connection waits for it at most ``heartbeat_interval``;
one in flight is abandoned as soon as the heartbeat turns unhealthy. Each of those is a miss,
not an error; a transfer channel that lost its connection also clears the health, so the next
transfers answer at once until a good PING. An outage logs one WARNING, its end one INFO line.
``_reg_lock`` guards ``_registration`` and the REGISTER counters: a registration and a recovery
never interleave; the misses and the outages are counted and logged by
`dataplane.client.outage`.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
import zmq

from dataplane.client.args import check_args, check_copy_threads, check_kv_compression
from dataplane.client.channel import Channel
from dataplane.client.engine_driven import EngineDrivenTransport
from dataplane.client.heartbeat import Heartbeat
from dataplane.client.kvalloc import unlink_segments
from dataplane.client.outage import OutageLog
from dataplane.client.transport import Identity, ServerDrivenTransport, Transport
from dataplane.memory.rope import RopeParams
from dataplane.wire.blocks import EngineBlocks
from dataplane.wire.errors import KVWardenError, NotRegistered, RequestAborted, RequestTimeout
from dataplane.wire.messages import (
    BlendRegister,
    EngineRegister,
    Hello,
    KeyContext,
    KVFormat,
    Lookup,
    Message,
    Ping,
    Register,
    TransferMode,
    Unregister,
)
from dataplane.wire.records import Reply
from dataplane.wire.replies import (
    NO_STORE,
    Hits,
    PingReply,
    PoolRegistered,
    Registered,
    ServerHello,
    StoreCounts,
)

logger = logging.getLogger(__name__)

TokenIds = Sequence[int] | np.ndarray | torch.Tensor
Ctx = KeyContext | None
Names = EngineBlocks | None  # the engine's names of the blocks a STORE covers (KV events)
T = TypeVar("T")
R = TypeVar("R", bound=Reply)


def _id_array(x: TokenIds) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


class WorkerAdapter:
    """A worker's connection to the kvwarden server (see the module docstring).

    Counters: ``registrations`` (REGISTERs that built a fresh server context), ``refreshes``
    (REGISTERs answered as a no-op refresh) and ``misses``: transfers answered with the outage
    answer (``store`` False or zero counts, ``lookup`` and ``retrieve`` 0) instead of the
    server's, because the server was unhealthy, did not answer in time, closed the connection
    or no longer knew this instance. A transfer of an adapter that never registered raises
    instead: that is a usage error, not an outage.
    """

    def __init__(
        self,
        endpoint: str,
        model_name: str,
        world_size: int = 1,
        worker_id: int = 0,
        heartbeat_interval: float = 10.0,
        transfer_mode: str = "server_driven",
        request_timeout: float = 30.0,
        instance_id: int | None = None,
        on_health_change: Callable[[bool], None] | None = None,
        pool_chunks: int = 4,
        copy_threads: int | None = None,
        kv_compression: str = "none",
    ) -> None:
        check_args(transfer_mode, pool_chunks, heartbeat_interval, world_size, worker_id)
        copy_threads = check_copy_threads(transfer_mode, copy_threads)
        self.kv_compression = check_kv_compression(transfer_mode, kv_compression)
        self.endpoint = endpoint
        self.model_name = model_name
        self.world_size = world_size
        self.worker_id = worker_id
        self.transfer_mode = TransferMode(transfer_mode)
        self.heartbeat_interval = heartbeat_interval
        self.request_timeout = request_timeout
        self.instance_id = instance_id if instance_id is not None else uuid.uuid4().int & ((1 << 63) - 1)
        self._secret = secrets.token_bytes(16)  # this instance's: every request carries it
        who = Identity(self.instance_id, self._secret, model_name, world_size, worker_id, os.getpid())
        self._transport: Transport = (
            EngineDrivenTransport(who, pool_chunks, copy_threads, kv_compression)
            if self.transfer_mode is TransferMode.ENGINE_DRIVEN
            else ServerDrivenTransport(who)
        )
        logger.info(
            "kvwarden client: instance id %d (%s rank %d/%d)",
            self.instance_id,
            model_name,
            worker_id,
            world_size,
        )
        self._ctx: zmq.Context[Any] = zmq.Context()
        # once connected, no request waits longer than a heartbeat for a lost connection
        self._chan = Channel(self._ctx, endpoint, reconnect_wait_s=heartbeat_interval)
        self._hb_chan = Channel(self._ctx, endpoint, reconnect_wait_s=heartbeat_interval)
        self._heartbeat = Heartbeat(
            self._ping,
            self._recover,
            lambda: self.registration is not None,
            heartbeat_interval,
            on_health_change,
        )
        self._reg_lock = threading.Lock()  # guards _registration, registrations, refreshes
        self._registration: Register | EngineRegister | None = None
        self._blend: BlendRegister | None = None  # RoPE parameters given (re-sent on a fresh context)
        self.chunk_size: int | None = None
        self.registrations = 0  # REGISTERs that built a fresh server context
        self.refreshes = 0  # REGISTERs the server answered as a no-op refresh (created: false)
        self._outages = OutageLog(logger)
        self._closed = False

    # ------------------------------------------------------------------ state
    @property
    def is_healthy(self) -> bool:
        return self._heartbeat.healthy.is_set()

    @property
    def misses(self) -> int:
        """Transfers answered with the outage answer (class docstring)."""
        return self._outages.misses

    @property
    def boot_token(self) -> int | None:
        return self._heartbeat.boot_token

    @property
    def registration(self) -> Register | EngineRegister | None:
        """The REGISTER message this adapter sends (None before ``register_kv_caches``)."""
        with self._reg_lock:
            return self._registration

    @property
    def segments(self) -> list[str]:
        """The shared-memory segments of the registered caches (none when engine-driven)."""
        return list(self._transport.segments)

    def server_info(self) -> ServerHello:
        return self._chan.request(Hello(), self.request_timeout)

    # ----------------------------------------------------------- registration
    def register_kv_caches(self, caches: Sequence[torch.Tensor], kv_format: str = "token_major") -> None:
        """Register the per-layer KV tensors. ``kv_format`` says how they are laid out
        (`dataplane.wire.messages.KVFormat`): ``token_major`` tensors are ``[2, num_blocks,
        block_size, heads, head_dim]``; ``vllm_cpu`` ones ``[num_blocks, heads, block_size,
        2 * head_dim]`` (vLLM's CPU backend; engine-driven only, moved in whole blocks); ``latent``
        ones ``[num_blocks, 1, block_size, latent_dim]`` (multi-head latent attention, one latent
        a token: engine-driven only, moved in whole blocks, keyed once for every rank)."""
        formats = [f.value for f in KVFormat]
        if kv_format not in formats:
            raise ValueError(f"kv_format {kv_format!r}: use {' or '.join(map(repr, formats))}")
        msg = self._transport.registration(caches, KVFormat(kv_format))
        with self._reg_lock:
            info = self.server_info()
            self.chunk_size = info.chunk_size
            self._heartbeat.adopt(info.boot_token)
            self._registration = msg
            self._send_register(self._chan, msg)
        self.start_heartbeat()

    def _send_register(self, chan: Channel, msg: Register | EngineRegister) -> None:
        """One REGISTER and its bookkeeping; ``_reg_lock`` held."""
        result: Reply = chan.request(msg, self.request_timeout)
        assert isinstance(result, Registered | PoolRegistered)  # (the table's rows for both)
        if result.created:
            self.registrations += 1
        else:
            self.refreshes += 1
        self._transport.registered(result)
        if self._blend is not None and result.created:  # a fresh context: RoPE again
            chan.request(self._blend, self.request_timeout)

    def start_heartbeat(self) -> None:
        self._heartbeat.start()

    def heartbeat_once(self) -> None:
        """One PING and its consequences (public so tests can drive it without the thread)."""
        self._heartbeat.beat()

    def _ping(self) -> PingReply:
        return self._hb_chan.request(Ping(self.instance_id, self._secret), self.heartbeat_interval)

    def _recover(self) -> bool:
        """Re-register on the heartbeat's channel (a no-op refresh when the server kept us)."""
        with self._reg_lock:
            if self._closed:
                return False  # no ghost registration after close()
            if self._registration is None:
                return True
            try:
                self._send_register(self._hb_chan, self._registration)
            except Exception as exc:
                logger.warning("kvwarden client: re-register failed: %s", exc)
                return False
            return True

    # ---- transfers. ``key``: what the KV depends on beyond the tokens, and who may see it (salt,
    # LoRA adapter, multimodal inputs: `dataplane.client.keys.key_context`); a chunk stored under
    # one context is only ever found under the same one. ``names`` (`Names`) never changes a key.
    def store(self, token_ids: TokenIds, block_ids: TokenIds, key: Ctx = None, names: Names = None) -> bool:
        """Store every full chunk; True when all of them are held by the server afterwards.
        False, without waiting, while unhealthy or when the server no longer knew us."""
        r = self._store(token_ids, block_ids, key, names)
        return r is not None and r.complete

    def store_detail(
        self, token_ids: TokenIds, block_ids: TokenIds, key: Ctx = None, names: Names = None, first: int = 0
    ) -> StoreCounts:
        """STORE's counts: chunks, stored (written now), present (already held), rejected,
        skipped (`dataplane.wire.replies.StoreCounts`); all 0 without an answer. ``first``: the
        first chunk to store (engine-driven; the blocks before it are not the prompt's)."""
        r = self._store(token_ids, block_ids, key, names, first)
        return NO_STORE if r is None else r

    def _store(
        self, token_ids: TokenIds, block_ids: TokenIds, key: Ctx, names: Names, first: int = 0
    ) -> StoreCounts | None:
        def run() -> StoreCounts | None:
            tokens, blocks = _id_array(token_ids), _id_array(block_ids)
            return self._transport.store(self._send, tokens, blocks, self.chunk_size, key, names, first)

        return self._unless_outage(run, None)

    def lookup(self, token_ids: TokenIds, key: KeyContext | None = None) -> int:
        return self.lookup_detail(token_ids, key).hit_tokens  # prefix tokens held

    def lookup_detail(self, token_ids: TokenIds, key: KeyContext | None = None) -> Hits:
        """Prefix tokens held, and after them those being stored now (none while unhealthy)."""
        msg = Lookup(self.instance_id, self._secret, _id_array(token_ids), key)
        return self._unless_outage(lambda: self._send(msg), Hits(0, 0))

    def retrieve(
        self, token_ids: TokenIds, block_ids: TokenIds, key: KeyContext | None = None, first: int = 0
    ) -> int:
        """Write the longest stored prefix into ``block_ids``; returns its token count. From
        chunk ``first`` on (engine-driven): the chunks a sliding-window layer group needs, block
        id -1 marking a block not to write; the count then includes the ``first`` chunks'."""

        def run() -> int:
            tokens, blocks = _id_array(token_ids), _id_array(block_ids)
            return self._transport.retrieve(self._send, tokens, blocks, self.chunk_size, key, first)

        return self._unless_outage(run, 0)

    def _send(self, msg: Message[R]) -> R:
        """A transfer request; abandoned (RequestAborted) as soon as the heartbeat declares the
        server unhealthy, so a frozen server never holds a worker for the whole timeout."""
        return self._chan.request(msg, self.request_timeout, abort=lambda: not self.is_healthy)

    def _unless_outage(self, fn: Callable[[], T], miss: T) -> T:
        """``fn()``, or ``miss`` without waiting while the server is unhealthy, when a transfer
        is abandoned or times out, or when the server no longer knew us (then we re-register
        at once). Misses are counted; an outage is logged once."""
        if not self.is_healthy:
            return self._missed(miss, "the server is unhealthy")
        try:
            value = fn()
        except NotRegistered:
            self._reregister_now()
            return self._missed(miss, "the server no longer knew this instance")
        except (RequestAborted, RequestTimeout) as exc:
            # (read without _reg_lock: a recovery may hold it for a whole REGISTER, and a
            # failed transfer must not wait on that; reading one reference is atomic)
            if self._registration is None:
                raise  # never registered (or closed): a usage error, not an outage
            if not self._chan.connected and self._heartbeat.running:
                self._heartbeat.set_health(False)  # no connection: the next ones answer at once
            return self._missed(miss, str(exc))
        self._outages.served()
        return value

    def _missed(self, miss: T, why: str) -> T:
        """Count a miss (the first of an outage logs one WARNING); returns ``miss``."""
        self._outages.missed(why)
        return miss

    def _reregister_now(self) -> None:
        """The server dropped us (reaped while paused, or by an operator) and our next PING
        has not told us yet: re-register now; this request counts as a miss. An adapter that
        never registered gets the error: that is a usage error, not an outage."""
        if self.registration is None:
            raise NotRegistered(
                f"instance {self.instance_id} is not registered: call register_kv_caches() first"
            )
        logger.warning("kvwarden client: server does not know instance %d: re-registering", self.instance_id)
        token = self._heartbeat.boot_token
        if token is not None:
            self._heartbeat.recover(token, failure_is_outage=False)

    # ------------------------------------------------------------------ blend
    def register_blend(self, rope: RopeParams | dict[str, Any]) -> None:
        """Give the server this worker's RoPE parameters (`dataplane.memory.rope.RopeParams`:
        rotary_dim, base, style "neox" or "interleaved", scaling, max_positions), for blend
        transfers; sent again whenever the server builds a fresh context for this instance. A
        bad parameter raises the server's RequestError naming it."""
        p = rope if isinstance(rope, RopeParams) else RopeParams(**rope)
        msg = BlendRegister(
            self.instance_id,
            self._secret,
            int(p.rotary_dim),
            float(p.base),
            str(p.style),
            float(p.scaling),
            int(p.max_positions),
        )
        with self._reg_lock:
            if self._registration is None:
                raise NotRegistered("register_kv_caches() first, then register_blend()")
            self._chan.request(msg, self.request_timeout)
            self._blend = msg
        self._transport.set_rope(p)

    def store_blend(
        self, token_ids: TokenIds, block_ids: TokenIds, position: int, key: KeyContext | None = None
    ) -> StoreCounts:
        """Store every full chunk independently of what precedes it; chunk i is at ``position +
        i * chunk_size`` in this sequence. STORE's counts (all zero during an outage)."""
        tokens, blocks = _id_array(token_ids), _id_array(block_ids)
        return self._unless_outage(
            lambda: self._transport.store_blend(self._send, tokens, blocks, position, self.chunk_size, key),
            NO_STORE,
        )

    def retrieve_blend(
        self, token_ids: TokenIds, block_ids: TokenIds, position: int, key: KeyContext | None = None
    ) -> list[tuple[int, bool]]:
        """Write each held chunk into its blocks, keys rotated to ``position + i * chunk_size``;
        (chunk index, hit) for every full chunk, so the engine knows which to recompute."""
        tokens, blocks = _id_array(token_ids), _id_array(block_ids)
        n = len(tokens) // (self.chunk_size or 1)
        return self._unless_outage(
            lambda: self._transport.retrieve_blend(
                self._send, tokens, blocks, position, self.chunk_size, key
            ),
            [(i, False) for i in range(n)],
        )

    # ------------------------------------------------------------------ close
    def close(self, unlink: bool = True) -> None:
        """Stop the heartbeat, UNREGISTER, then release sockets (and our segments)."""
        if self._closed:
            return
        self._closed = True  # read by _recover under _reg_lock: no re-register from here on
        self._heartbeat.stop()
        self._heartbeat.join(self.heartbeat_interval + 5.0)
        with self._reg_lock:
            registered = self._registration is not None
            self._registration = None
        if registered:
            try:
                self._chan.request(Unregister(self.instance_id, self._secret), min(self.request_timeout, 5.0))
            except KVWardenError as exc:
                logger.warning("kvwarden client: UNREGISTER failed: %s", exc)
        self._chan.close()
        self._hb_chan.close()
        self._ctx.term()
        self._transport.close()
        if unlink:
            unlink_segments(self._transport.segments)

    def __enter__(self) -> WorkerAdapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
