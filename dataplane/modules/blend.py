"""The blend module: chunks reused at any position (after CacheBlend), with per-instance RoPE.

BLEND_REGISTER gives an instance's RoPE parameters; the module checks them against the
instance's head dim and builds its cos/sin tables once (`dataplane.memory.rope.RopeTables`).
BLEND_STORE keeps each full chunk under a key of its own tokens only (not the prefix chain: the
same passage after any prefix is the same key), with its keys rotated back to position 0.
BLEND_RETRIEVE looks each chunk up independently and writes the ones held into the given blocks
with their keys rotated to the chunk's target position; values are never touched. The answer
says which chunks were hit, so the engine recomputes the others (and, as CacheBlend does, the
cross-attention between chunks).

The tables are per-instance state and nothing else: the module is a liveness target that
overrides only ``drop_instance_state``, so a reap, an admin reap or an UNREGISTER drops them.
``_lock`` guards ``_tables``. Server-driven instances only, for now: an engine-driven one gets
an error that says so.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from dataplane.liveness.target import InstanceLivenessTarget
from dataplane.memory.copies import token_slots
from dataplane.memory.kvmemory import MappedKV
from dataplane.memory.rope import RopeParams, RopeTables
from dataplane.modules.base import Handler, HandlerKind, RequestContext
from dataplane.modules.engine import EngineDrivenTransferModule
from dataplane.modules.transfer import ServerDrivenTransferModule
from dataplane.storage.keys import KEY_BYTES
from dataplane.wire.checks import ID_DTYPE
from dataplane.wire.errors import RequestError
from dataplane.wire.messages import BlendRegister, BlendRetrieve, BlendStore, BlendTransfer, MsgType


def blend_keys(scope: bytes, token_ids: np.ndarray, chunk_size: int) -> list[bytes]:
    """A key per full chunk, from the scope and that chunk's tokens alone."""
    tokens = np.ascontiguousarray(token_ids, dtype=ID_DTYPE)
    step = chunk_size * ID_DTYPE.itemsize
    raw = memoryview(tokens.tobytes())
    out = []
    for i in range(len(tokens) // chunk_size):
        h = hashlib.blake2b(scope, digest_size=KEY_BYTES, person=b"kvwarden-blend")
        h.update(raw[i * step : (i + 1) * step])
        out.append(h.digest())
    return out


class BlendModule(InstanceLivenessTarget):
    name = "blend"

    def __init__(self, transfer: ServerDrivenTransferModule, engine: EngineDrivenTransferModule) -> None:
        self.transfer = transfer
        self.engine = engine
        self.chunk_size = transfer.chunk_size
        self._lock = threading.Lock()  # guards _tables
        self._tables: dict[int, RopeTables] = {}

    def handlers(self) -> dict[MsgType, Handler]:
        key = self.transfer.order_key
        return {
            MsgType.BLEND_REGISTER: Handler(HandlerKind.NORMAL, self._register),
            MsgType.BLEND_STORE: Handler(HandlerKind.TRANSFER, self._store, key),
            MsgType.BLEND_RETRIEVE: Handler(HandlerKind.TRANSFER, self._retrieve, key),
        }

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def close(self) -> None:
        with self._lock:
            self._tables.clear()

    def report_status(self) -> dict[str, Any]:
        return {"blend_instances": self.instance_count()}

    def instance_count(self) -> int:
        with self._lock:
            return len(self._tables)

    # ------------------------------------------------------------ liveness
    def drop_instance_state(self, instance_id: int) -> None:
        with self._lock:
            self._tables.pop(instance_id, None)

    # ------------------------------------------------------------ handlers
    def _refuse_engine_driven(self, rctx: RequestContext, iid: int, secret: bytes) -> None:
        if self.engine.registry.scope_of(iid, rctx.conn_fd, secret) is not None:
            raise RequestError(
                f"instance {iid} is engine_driven: blend transfers need a server_driven instance for now"
            )

    def _register(self, rctx: RequestContext, p: BlendRegister) -> dict[str, Any]:
        self._refuse_engine_driven(rctx, p.instance_id, p.secret)
        with self.transfer.registry.use(p.instance_id, rctx.conn_fd, p.secret) as c:
            assert c.kv is not None
            head_dim = c.kv.head_dim
        params = RopeParams(p.rotary_dim, p.base, p.style, p.scaling, p.max_positions)
        try:
            params.check(head_dim)
        except ValueError as exc:
            raise RequestError(f"BLEND_REGISTER.{exc}") from None
        tables = RopeTables(params)  # built once, outside every lock
        with self._lock:
            self._tables[p.instance_id] = tables
        return {"table_bytes": tables.nbytes}

    def _tables_of(self, iid: int) -> RopeTables:
        with self._lock:
            t = self._tables.get(iid)
        if t is None:
            raise RequestError(
                f"instance {iid} has not registered its RoPE parameters (BLEND_REGISTER first)"
            )
        return t

    def _slots(self, kv: MappedKV, p: BlendTransfer, n_tokens: int) -> np.ndarray:
        try:
            return token_slots(p.block_ids, kv.block_size, kv.num_blocks, n_tokens)
        except ValueError as exc:
            raise RequestError(str(exc)) from None

    def _keys_view(self, kv: MappedKV, buf: torch.Tensor) -> torch.Tensor:
        """The K half of a chunk buffer, [layers, tokens, heads, head_dim]."""
        cs = self.chunk_size
        return buf.view(kv.dtype).view(kv.num_layers, 2, cs, kv.heads, kv.head_dim)[:, 0]

    def _shift(self, tables: RopeTables, keys: torch.Tensor, offset: int) -> None:
        """Rotate a chunk's keys ([layers, ...]) in place, split by layers across the copy threads."""
        splitter = self.transfer.splitter

        def part(lo: int, hi: int) -> None:
            tables.shift_(keys[lo:hi], offset)

        if splitter is None:
            part(0, keys.shape[0])
        else:
            splitter.run(part, keys.shape[0])

    @contextlib.contextmanager
    def _open(
        self, rctx: RequestContext, p: BlendTransfer
    ) -> Iterator[tuple[RopeTables, MappedKV, list[bytes], np.ndarray]]:
        """What BLEND_STORE and BLEND_RETRIEVE both check and derive: the instance's tables, its
        mapping (held in use meanwhile), each full chunk's key and the token slots they cover."""
        self._refuse_engine_driven(rctx, p.instance_id, p.secret)
        tables, cs = self._tables_of(p.instance_id), self.chunk_size
        with self.transfer.registry.use(p.instance_id, rctx.conn_fd, p.secret) as c:
            kv = c.kv
            assert kv is not None
            keys = blend_keys(c.scope, p.token_ids, cs)
            slots = self._slots(kv, p, len(keys) * cs)
            self._check_span(tables, p.position, len(keys))
            yield tables, kv, keys, slots

    def _store(self, rctx: RequestContext, p: BlendStore) -> dict[str, Any]:
        cs = self.chunk_size
        with self._open(rctx, p) as (tables, kv, keys, slots):

            def fill(i: int, buf: torch.Tensor) -> None:
                kv.gather(slots[i * cs : (i + 1) * cs], buf, self.transfer.splitter)
                self._shift(tables, self._keys_view(kv, buf), -(p.position + i * cs))  # as if at 0

            return self.transfer.write_chunks(p.instance_id, keys, kv.chunk_nbytes(cs), fill)

    def _check_span(self, tables: RopeTables, position: int, chunks: int) -> None:
        end = position + chunks * self.chunk_size
        if end > tables.params.max_positions:
            raise RequestError(
                f"position: chunks up to position {end} exceed the registered max_positions "
                f"{tables.params.max_positions}"
            )

    def _retrieve(self, rctx: RequestContext, p: BlendRetrieve) -> dict[str, Any]:
        cs, l1 = self.chunk_size, self.transfer.l1
        with self._open(rctx, p) as (tables, kv, keys, slots):
            hits: list[list[Any]] = []
            tmp = torch.empty(kv.chunk_nbytes(cs), dtype=torch.uint8)
            for i, key in enumerate(keys):
                got = l1.acquire_prefix([key])
                if got:
                    try:
                        tmp.copy_(got[0])
                    finally:
                        l1.release([key])
                    self._shift(tables, self._keys_view(kv, tmp), p.position + i * cs)
                    kv.scatter(slots[i * cs : (i + 1) * cs], tmp, self.transfer.splitter)
                hits.append([i, bool(got)])
        n_hit = sum(1 for _, h in hits if h)
        self.transfer.metrics.transfer_bytes.labels(direction="retrieve").inc(n_hit * kv.chunk_nbytes(cs))
        return {"chunks": hits}
