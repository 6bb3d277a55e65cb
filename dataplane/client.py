"""The worker side: ``allocate_kv_caches`` and ``WorkerAdapter``.

    caches = allocate_kv_caches(num_layers=32, num_blocks=1024, block_size=16,
                                num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    w = WorkerAdapter("tcp://127.0.0.1:5555", model_name="m", world_size=1, worker_id=0)
    w.register_kv_caches(caches)
    w.store(token_ids, block_ids); w.lookup(token_ids); w.retrieve(token_ids, block_ids)
    w.close()

Every request has a timeout; an error reply raises the typed exception of `dataplane.errors`.
A heartbeat thread, started at registration, PINGs with the instance id on its own socket
(a long transfer never delays it). It re-registers at once when the server's boot token changes
(the server restarted) or when the server says the id is unknown (it was reaped), and marks the
adapter unhealthy while PINGs fail: stores are then dropped and retrieves report a miss instead
of waiting on a dead server.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import zmq

from dataplane.channel import Channel
from dataplane.errors import (
    ClientError,
    KVWardenError,
    NotRegistered,
    RequestAborted,
)
from dataplane.kvalloc import _layout, allocate_kv_caches, free_kv_caches, unlink_segments
from dataplane.kvmemory import DTYPE_NAMES, MappedKV, map_local_tensors, token_slots
from dataplane.protocol import (
    MAX_POOL_CHUNKS,
    MsgType,
    ids_to_bytes,
)
from dataplane.shm import Segment

__all__ = ["WorkerAdapter", "allocate_kv_caches", "free_kv_caches"]

logger = logging.getLogger(__name__)

REAP_TIMEOUT_FLOOR_S = 30.0
TokenIds = Sequence[int] | np.ndarray | torch.Tensor

def _id_array(x: TokenIds) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def _ids(x: TokenIds) -> bytes:
    return ids_to_bytes(_id_array(x))


class WorkerAdapter:
    """A worker's connection to the kvwarden server (see the module docstring)."""

    def __init__(self, endpoint: str, model_name: str, world_size: int = 1, worker_id: int = 0,
                 heartbeat_interval: float = 10.0, transfer_mode: str = "server_driven",
                 request_timeout: float = 30.0, instance_id: int | None = None,
                 on_health_change: Callable[[bool], None] | None = None,
                 pool_chunks: int = 4) -> None:
        if transfer_mode not in ("server_driven", "engine_driven"):
            raise ValueError(
                f"transfer_mode {transfer_mode!r}: use 'server_driven' or 'engine_driven'"
            )
        if not 1 <= pool_chunks <= MAX_POOL_CHUNKS:
            raise ValueError(f"pool_chunks must be in [1, {MAX_POOL_CHUNKS}]")
        if not heartbeat_interval > 0:
            raise ValueError("heartbeat_interval must be > 0")
        if not 0 <= worker_id < world_size:
            raise ValueError(f"worker_id {worker_id} must be in [0, world_size {world_size})")
        self.endpoint = endpoint
        self.model_name = model_name
        self.world_size = world_size
        self.worker_id = worker_id
        self.transfer_mode = transfer_mode
        self.pool_chunks = pool_chunks
        self.heartbeat_interval = heartbeat_interval
        self.request_timeout = request_timeout
        self.instance_id = (
            instance_id if instance_id is not None else uuid.uuid4().int & ((1 << 63) - 1)
        )
        self._on_health_change = on_health_change
        logger.info("kvwarden client: instance id %d (%s rank %d/%d)", self.instance_id,
                    model_name, worker_id, world_size)
        if 3 * heartbeat_interval > REAP_TIMEOUT_FLOOR_S:
            logger.warning(
                "kvwarden client: 3 x heartbeat_interval (%gs) exceeds the server's %gs reap "
                "floor: a server at the floor may reap this live worker", 3 * heartbeat_interval,
                REAP_TIMEOUT_FLOOR_S)
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._chan = Channel(self._ctx, endpoint)
        self._hb_chan = Channel(self._ctx, endpoint)
        self._healthy = threading.Event()
        self._healthy.set()  # healthy from the start: the first transfer is not gated
        self._stop = threading.Event()
        self._reg_lock = threading.Lock()  # guards _register_payload, _boot_token, registration
        self._register_payload: list[Any] | None = None
        self._segments: list[str] = []
        self._boot_token: int | None = None
        self.chunk_size: int | None = None
        self.registrations = 0  # REGISTERs that built a fresh server context
        self._hb_thread: threading.Thread | None = None
        self._closed = False
        # engine-driven: our tensors and the server's chunk pool (one transfer at a time)
        self._xfer_lock = threading.Lock()  # guards _pool and the pool's slots
        self._local: MappedKV | None = None
        self._pool: tuple[Segment, list[torch.Tensor]] | None = None

    # ------------------------------------------------------------------ state
    @property
    def is_healthy(self) -> bool:
        return self._healthy.is_set()

    @property
    def boot_token(self) -> int | None:
        return self._boot_token

    def server_info(self) -> dict[str, Any]:
        info: dict[str, Any] = self._chan.request(MsgType.HELLO, [], self.request_timeout)
        return info

    # ------------------------------------------------------------ registration
    def register_kv_caches(self, caches: Sequence[torch.Tensor]) -> None:
        if self.transfer_mode == "engine_driven":
            first = caches[0]
            if len(first.shape) != 5 or first.shape[0] != 2:
                raise ValueError("KV tensors must be [2, num_blocks, block_size, heads, head_dim]")
            for i, t in enumerate(caches):
                if t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous():
                    raise ValueError(f"layer {i}: shape/dtype differ from layer 0 or not contiguous")
            self._local = map_local_tensors(list(caches))
            payload = [self.instance_id, self.model_name, self.world_size, self.worker_id,
                       DTYPE_NAMES[first.dtype], len(caches), int(first.shape[3]),
                       int(first.shape[4]), self.pool_chunks, _own_pid()]
            segments: list[str] = []
        else:
            memory, dtype, shape, layers = _layout(caches)
            payload = [self.instance_id, self.model_name, self.world_size, self.worker_id,
                       self.transfer_mode, memory, dtype, shape, _own_pid(), layers]
            segments = [lay[0] for lay in layers] if memory == "shm" else []
        with self._reg_lock:
            info = self.server_info()
            self._boot_token = int(info["boot_token"])
            self.chunk_size = int(info["chunk_size"])
            self._register_payload = payload
            self._segments = segments
            self._send_register(self._chan)
        self.start_heartbeat()

    def _send_register(self, chan: Channel) -> bool:
        assert self._register_payload is not None
        mtype = (MsgType.ENGINE_REGISTER if self.transfer_mode == "engine_driven"
                 else MsgType.REGISTER_KV_CACHE)
        result = chan.request(mtype, self._register_payload, self.request_timeout)
        created = bool(result.get("created"))
        if created:
            self.registrations += 1
        if mtype is MsgType.ENGINE_REGISTER:
            self._map_pool(str(result["segment"]), int(result["slot_bytes"]), int(result["slots"]))
        return created

    def _map_pool(self, name: str, slot_bytes: int, slots: int) -> None:
        with self._xfer_lock:
            if self._pool is not None and self._pool[0].name == name:
                return
            seg = Segment.attach(name, slot_bytes * slots)
            flat = seg.as_tensor()
            views = [flat[i * slot_bytes:(i + 1) * slot_bytes] for i in range(slots)]
            old, self._pool = self._pool, (seg, views)
        if old is not None:
            old[1].clear()
            old[0].close()

    def start_heartbeat(self) -> None:
        if self._hb_thread is None:
            self._hb_thread = threading.Thread(target=self._heartbeat_loop,
                                               name="kvwarden-heartbeat", daemon=True)
            self._hb_thread.start()

    # ------------------------------------------------------------- heartbeat
    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_interval):
            self.heartbeat_once()

    def heartbeat_once(self) -> None:
        """One PING and its consequences (public so tests can drive it without a thread)."""
        try:
            reply = self._hb_chan.request(MsgType.PING, [self.instance_id], self.heartbeat_interval)
        except (KVWardenError, zmq.ZMQError) as exc:
            if self._stop.is_set():
                return
            if self._healthy.is_set():
                logger.warning("kvwarden client: PING failed (%s): unhealthy", exc)
                self._set_health(False)
            return
        if self._stop.is_set():
            return
        token = int(reply["boot_token"])
        reason = None
        if self._boot_token is not None and token != self._boot_token:
            reason = f"server restarted (boot token {self._boot_token} -> {token})"
        elif self._register_payload is not None and reply.get("tracked") is False:
            reason = "server no longer tracks this instance"
        if reason is None and self._healthy.is_set():
            return
        if reason:
            logger.warning("kvwarden client: %s: re-registering", reason)
        if self._recover(token):
            self._set_health(True)
        else:
            self._set_health(False)

    def _recover(self, token: int) -> bool:
        """Re-register (a no-op refresh when the server kept us). Never raises."""
        with self._reg_lock:
            if self._stop.is_set():
                return False  # no ghost registration after close()
            if self._register_payload is None:
                self._boot_token = token
                return True
            try:
                self._send_register(self._hb_chan)
            except Exception as exc:
                logger.warning("kvwarden client: re-register failed: %s", exc)
                return False
            self._boot_token = token
            return True

    def _set_health(self, healthy: bool) -> None:
        was = self._healthy.is_set()
        if healthy:
            self._healthy.set()
        else:
            self._healthy.clear()
        if was != healthy:
            logger.info("kvwarden client: %s", "healthy" if healthy else "unhealthy")
            if self._on_health_change is not None:
                self._on_health_change(healthy)

    # ------------------------------------------------------------- transfers
    def store(self, token_ids: TokenIds, block_ids: TokenIds) -> bool:
        """Store every full chunk; True when all of them are held by the server afterwards.
        False, without waiting, while unhealthy or when the server no longer knew us."""
        r = self._store(token_ids, block_ids)
        return r is not None and r["rejected"] == 0

    def store_detail(self, token_ids: TokenIds, block_ids: TokenIds) -> dict[str, int]:
        """STORE's counts: chunks, stored (written now), present (already held), rejected."""
        r = self._store(token_ids, block_ids)
        return r if r is not None else {"chunks": 0, "stored": 0, "present": 0, "rejected": 0}

    def _store(self, token_ids: TokenIds, block_ids: TokenIds) -> dict[str, int] | None:
        if not self._healthy.is_set():
            return None
        try:
            if self.transfer_mode == "engine_driven":
                return self._engine_store(token_ids, block_ids)
            r: dict[str, int] = self._xfer(MsgType.STORE, _ids(token_ids), _ids(block_ids))
            return r
        except NotRegistered:
            self._reregister_now()
            return None
        except RequestAborted:
            return None

    def _xfer(self, mtype: MsgType, *payload: Any) -> Any:
        """A transfer request; abandoned (RequestAborted) as soon as the heartbeat declares the
        server unhealthy, so a frozen server never holds a worker for the whole timeout."""
        return self._chan.request(mtype, [self.instance_id, *payload], self.request_timeout,
                                  abort=lambda: not self._healthy.is_set())

    def _reregister_now(self) -> None:
        """The server dropped us (reaped while paused, or by an operator) and our next PING
        has not told us yet: re-register now; this request counts as a miss. An adapter that
        never registered gets the error: that is a usage error, not an outage."""
        if self._register_payload is None:
            raise NotRegistered(f"instance {self.instance_id} is not registered: "
                                "call register_kv_caches() first")
        logger.warning("kvwarden client: server does not know instance %d: re-registering",
                       self.instance_id)
        if self._boot_token is not None and self._recover(self._boot_token):
            self._set_health(True)

    def _engine_store(self, token_ids: TokenIds, block_ids: TokenIds) -> dict[str, int]:
        tokens = _ids(token_ids)
        cs, local = self._chunk_size(), self._require_local()
        n_full = len(tokens) // 4 // cs
        present = self.lookup(token_ids) // cs  # those need no copy
        slots = token_slots(_id_array(block_ids), local.block_size, local.num_blocks, n_full * cs)
        total = {"chunks": n_full, "stored": 0, "present": present, "rejected": 0}
        first = present
        with self._xfer_lock:
            assert self._pool is not None
            pool = self._pool[1]
            while first < n_full:
                k = min(len(pool), n_full - first)
                for i in range(k):
                    c = first + i
                    local.gather(slots[c * cs:(c + 1) * cs], pool[i])
                r = self._xfer(MsgType.ENGINE_STORE, tokens[:(first + k) * cs * 4], first, k)
                for key in ("stored", "present", "rejected"):
                    total[key] += int(r[key])
                if r["rejected"]:
                    total["rejected"] += n_full - first - k
                    break
                first += k
        return total

    def lookup(self, token_ids: TokenIds) -> int:
        """Prefix tokens the server holds (0 while unhealthy)."""
        if not self._healthy.is_set():
            return 0
        try:
            r = self._xfer(MsgType.LOOKUP, _ids(token_ids))
        except NotRegistered:
            self._reregister_now()
            return 0
        except RequestAborted:
            return 0
        return int(r["hit_tokens"])

    def retrieve(self, token_ids: TokenIds, block_ids: TokenIds) -> int:
        """Write the longest stored prefix into ``block_ids``; returns its token count."""
        if not self._healthy.is_set():
            return 0
        try:
            if self.transfer_mode == "engine_driven":
                return self._engine_retrieve(token_ids, block_ids)
            r = self._xfer(MsgType.RETRIEVE, _ids(token_ids), _ids(block_ids))
        except NotRegistered:
            self._reregister_now()
            return 0
        except RequestAborted:
            return 0
        return int(r["retrieved_tokens"])

    def _engine_retrieve(self, token_ids: TokenIds, block_ids: TokenIds) -> int:
        tokens = _ids(token_ids)
        cs, local = self._chunk_size(), self._require_local()
        n_full = len(tokens) // 4 // cs
        blocks = _id_array(block_ids)
        first = 0
        with self._xfer_lock:
            assert self._pool is not None
            pool = self._pool[1]
            while first < n_full:
                k = min(len(pool), n_full - first)
                r = self._xfer(MsgType.ENGINE_RETRIEVE, tokens[:(first + k) * cs * 4], first, k)
                got = int(r["chunks"])
                slots = token_slots(blocks, local.block_size, local.num_blocks, (first + got) * cs)
                for i in range(got):
                    c = first + i
                    local.scatter(slots[c * cs:(c + 1) * cs], pool[i])
                first += got
                if got < k:
                    break
        return first * cs

    def _chunk_size(self) -> int:
        if self.chunk_size is None:
            raise ClientError("register_kv_caches() first")
        return self.chunk_size

    def _require_local(self) -> MappedKV:
        if self._local is None or self._pool is None:
            raise ClientError("register_kv_caches() first")
        return self._local

    # ---------------------------------------------------------------- close
    def close(self, unlink: bool = True) -> None:
        """Stop the heartbeat, UNREGISTER, then release sockets (and our segments)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(self.heartbeat_interval + 5.0)
        with self._reg_lock:
            registered = self._register_payload is not None
            self._register_payload = None
        if registered:
            try:
                self._chan.request(MsgType.UNREGISTER_KV_CACHE, [self.instance_id],
                                   min(self.request_timeout, 5.0))
            except (ClientError, KVWardenError) as exc:
                logger.warning("kvwarden client: UNREGISTER failed: %s", exc)
        self._chan.close()
        self._hb_chan.close()
        self._ctx.term()
        with self._xfer_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool[1].clear()
            pool[0].close()
        if unlink:
            unlink_segments(self._segments)

    def __enter__(self) -> WorkerAdapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _own_pid() -> int:
    import os

    return os.getpid()
