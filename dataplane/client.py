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

import atexit
import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import zmq

from dataplane.errors import (
    ClientError,
    KVWardenError,
    NotRegistered,
    RequestTimeout,
    ServerClosed,
    error_from_reply,
)
from dataplane.kvmemory import DTYPE_NAMES, MappedKV, map_local_tensors, token_slots
from dataplane.protocol import (
    MAX_POOL_CHUNKS,
    MsgType,
    decode_reply,
    encode_request,
    ids_to_bytes,
)
from dataplane.shm import Segment

logger = logging.getLogger(__name__)

REAP_TIMEOUT_FLOOR_S = 30.0
TokenIds = Sequence[int] | np.ndarray | torch.Tensor

# segments made by allocate_kv_caches in this process: name -> (segment, base address)
_SEGMENTS: dict[str, tuple[Segment, int]] = {}
_SEGMENTS_LOCK = threading.Lock()  # guards _SEGMENTS


def _unlink_all_at_exit() -> None:
    with _SEGMENTS_LOCK:
        for seg, _ in _SEGMENTS.values():
            seg.unlink()
        _SEGMENTS.clear()


atexit.register(_unlink_all_at_exit)


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype = torch.bfloat16,
                       device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """One ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer.

    On CPU all layers live in one shared-memory segment the server maps (zero-filled);
    on CUDA they are ordinary device tensors shared through CUDA IPC at registration.
    """
    for name, v in (("num_layers", num_layers), ("num_blocks", num_blocks),
                    ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                    ("head_dim", head_dim)):
        if int(v) <= 0:
            raise ValueError(f"{name} must be > 0, got {v}")
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} is not supported; use one of {sorted(DTYPE_NAMES.values())}")
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    dev = torch.device(device)
    if dev.type == "cuda":
        full = torch.zeros(shape, dtype=dtype, device=dev)
        return list(full.unbind(0))
    if dev.type != "cpu":
        raise ValueError(f"device {dev} is not supported (cpu or cuda)")
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    seg = Segment.create(nbytes)
    flat = seg.as_tensor()
    with _SEGMENTS_LOCK:
        _SEGMENTS[seg.name] = (seg, flat.data_ptr())
    full = flat.view(dtype).view(shape)
    return list(full.unbind(0))


def free_kv_caches(caches: Sequence[torch.Tensor]) -> None:
    """Unlink the segments behind ``caches`` (mappings stay valid until the tensors die).
    Segments already unlinked (by ``WorkerAdapter.close``) are skipped."""
    names = set()
    for t in caches:
        if t.device.type == "cpu":
            with contextlib.suppress(ValueError):
                names.add(_segment_of(t)[0].name)
    for name in names:
        with _SEGMENTS_LOCK:
            entry = _SEGMENTS.pop(name, None)
        if entry is not None:
            entry[0].unlink()


def _segment_of(t: torch.Tensor) -> tuple[Segment, int]:
    ptr = t.data_ptr()
    with _SEGMENTS_LOCK:
        for seg, base in _SEGMENTS.values():
            if base <= ptr < base + seg.size:
                return seg, ptr - base
    raise ValueError("tensor is not backed by shared memory from allocate_kv_caches()")


def _layout(caches: Sequence[torch.Tensor]) -> tuple[str, str, list[int], list[list[Any]]]:
    if not caches:
        raise ValueError("no KV cache tensors")
    first = caches[0]
    shape = list(first.shape)
    if len(shape) != 5 or shape[0] != 2:
        raise ValueError(f"KV tensors must be [2, num_blocks, block_size, heads, head_dim], got {shape}")
    for i, t in enumerate(caches):
        if list(t.shape) != shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(f"layer {i}: shape/dtype/device differ from layer 0")
        if not t.is_contiguous():
            raise ValueError(f"layer {i}: tensor is not contiguous")
    strides = list(first.stride())
    item = first.element_size()
    layers: list[list[Any]] = []
    if first.device.type == "cuda":
        memory = "cuda_ipc"
        for t in caches:
            st = t.untyped_storage()
            dev, handle, size, off, rc_h, rc_off, ev_h, ev_sync = st._share_cuda_()  # type: ignore[attr-defined,no-untyped-call]
            uuid_s = str(torch.cuda.get_device_properties(dev).uuid)
            layers.append([uuid_s, int(dev), bytes(handle), int(size), int(off),
                           t.storage_offset() * item, bytes(rc_h), int(rc_off), bytes(ev_h or b""),
                           bool(ev_sync), strides])
    else:
        memory = "shm"
        for t in caches:
            seg, offset = _segment_of(t)
            layers.append([seg.name, offset, strides])
    return memory, DTYPE_NAMES[first.dtype], shape, layers


class _Channel:
    """One DEALER socket: requests in order, replies matched by request id."""

    _ids = itertools.count(1)

    def __init__(self, ctx: zmq.Context[Any], endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue onto a dead connection
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        self.sock.connect(endpoint)
        self.lock = threading.Lock()  # guards sock: one request at a time

    def request(self, mtype: MsgType, payload: list[Any], timeout_s: float) -> Any:
        rid = next(self._ids)
        frame = encode_request(rid, mtype, payload)
        deadline = time.monotonic() + timeout_s
        with self.lock:
            if self.sock.closed:
                raise ServerClosed("adapter is closed")
            if not self.sock.poll(int(timeout_s * 1000), zmq.POLLOUT):
                raise RequestTimeout(f"{mtype}: no connection to the server within {timeout_s:g}s")
            self.sock.send(frame, zmq.NOBLOCK)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not self.sock.poll(max(1, int(left * 1000)), zmq.POLLIN):
                    raise RequestTimeout(f"{mtype}: no reply within {timeout_s:g}s")
                reply = decode_reply(self.sock.recv())
                if reply.request_id != rid and not (reply.request_id == 0 and not reply.ok):
                    continue  # a late reply to an earlier, timed-out request
                # (id 0: the server could not read our id; one request is in flight: it is ours)
                if not reply.ok:
                    body = reply.body if isinstance(reply.body, dict) else {}
                    raise error_from_reply(str(body.get("code")), str(body.get("message")))
                return reply.body

    def close(self) -> None:
        with self.lock:
            self.sock.close(linger=0)


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
        self._chan = _Channel(self._ctx, endpoint)
        self._hb_chan = _Channel(self._ctx, endpoint)
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

    def _send_register(self, chan: _Channel) -> bool:
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
            r: dict[str, int] = self._chan.request(
                MsgType.STORE, [self.instance_id, _ids(token_ids), _ids(block_ids)],
                self.request_timeout)
            return r
        except NotRegistered:
            self._reregister_now()
            return None

    def _reregister_now(self) -> None:
        """The server dropped us (reaped while paused, or by an operator) and our next PING
        has not told us yet: re-register now; this request counts as a miss."""
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
                r = self._chan.request(MsgType.ENGINE_STORE,
                                       [self.instance_id, tokens[:(first + k) * cs * 4], first, k],
                                       self.request_timeout)
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
            r = self._chan.request(MsgType.LOOKUP, [self.instance_id, _ids(token_ids)],
                                   self.request_timeout)
        except NotRegistered:
            self._reregister_now()
            return 0
        return int(r["hit_tokens"])

    def retrieve(self, token_ids: TokenIds, block_ids: TokenIds) -> int:
        """Write the longest stored prefix into ``block_ids``; returns its token count."""
        if not self._healthy.is_set():
            return 0
        try:
            if self.transfer_mode == "engine_driven":
                return self._engine_retrieve(token_ids, block_ids)
            r = self._chan.request(MsgType.RETRIEVE,
                                   [self.instance_id, _ids(token_ids), _ids(block_ids)],
                                   self.request_timeout)
        except NotRegistered:
            self._reregister_now()
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
                r = self._chan.request(MsgType.ENGINE_RETRIEVE,
                                       [self.instance_id, tokens[:(first + k) * cs * 4], first, k],
                                       self.request_timeout)
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
            for name in self._segments:
                with _SEGMENTS_LOCK:
                    entry = _SEGMENTS.pop(name, None)
                if entry is not None:
                    entry[0].unlink()

    def __enter__(self) -> WorkerAdapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _own_pid() -> int:
    import os

    return os.getpid()
