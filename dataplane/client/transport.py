"""One transport per transfer mode: how a worker's KV bytes reach the server.

``Transport`` is what `dataplane.client.adapter.WorkerAdapter` drives, through ``send``: a request
that is abandoned as soon as the adapter turns unhealthy. ``ServerDrivenTransport`` (here): the
server maps the worker's memory (shared memory on CPU, CUDA IPC on GPU) and does every copy; a
STORE or RETRIEVE is one request. ``EngineDrivenTransport`` (`dataplane.client.engine_driven`): the
worker keeps ordinary tensors and copies itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from dataplane.client.channel import Send as Send
from dataplane.client.kvalloc import describe_caches
from dataplane.memory.rope import RopeParams
from dataplane.wire.blocks import EngineBlocks
from dataplane.wire.messages import (
    BlendRetrieve,
    BlendStore,
    EngineRegister,
    KeyContext,
    KVFormat,
    Register,
    Retrieve,
    Store,
    TransferMode,
)
from dataplane.wire.replies import PoolRegistered, Registered, StoreCounts

BlendHits = list[tuple[int, bool]]  # (chunk index, hit) of a blend retrieve
Key = KeyContext | None  # what the chunks' KV depends on beyond their tokens (salt, adapter, ...)
NO_BLOCKS = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class Identity:
    """Who the worker is: the fields every registration carries."""

    instance_id: int
    secret: bytes  # carried by every request of the instance: only its registrant knows it
    model_name: str
    world_size: int
    worker_id: int
    owner_pid: int


class Transport(Protocol):
    segments: list[str]  # the worker's own segments, unlinked at close

    def registration(
        self, caches: Sequence[torch.Tensor], kv_format: KVFormat
    ) -> Register | EngineRegister: ...

    def registered(self, result: Registered | PoolRegistered) -> None: ...

    def store(
        self,
        send: Send,
        tokens: np.ndarray,
        blocks: np.ndarray,
        chunk_size: int | None,
        ctx: Key = None,
        names: EngineBlocks | None = None,
        first: int = 0,
    ) -> StoreCounts:
        """Store the full chunks of ``tokens`` from chunk ``first`` on (those before it are not
        in ``blocks``: a sliding window's blocks, freed)."""
        ...

    def retrieve(
        self,
        send: Send,
        tokens: np.ndarray,
        blocks: np.ndarray,
        chunk_size: int | None,
        ctx: Key = None,
        first: int = 0,
    ) -> int:
        """Retrieve the held full chunks of ``tokens`` from chunk ``first`` on into ``blocks``
        (a block id of -1: a block not to write); the tokens up to the last chunk written, or
        ``first`` chunks' tokens when none was."""
        ...

    def set_rope(self, params: RopeParams) -> None:
        """The RoPE parameters the server accepted (for a worker that rotates itself)."""

    def store_blend(
        self,
        send: Send,
        tokens: np.ndarray,
        blocks: np.ndarray,
        position: int,
        chunk_size: int | None,
        ctx: Key = None,
    ) -> StoreCounts: ...

    def retrieve_blend(
        self,
        send: Send,
        tokens: np.ndarray,
        blocks: np.ndarray,
        position: int,
        chunk_size: int | None,
        ctx: Key = None,
    ) -> BlendHits: ...

    def close(self) -> None: ...


class ServerDrivenTransport:
    def __init__(self, who: Identity) -> None:
        self.who = who
        self.segments: list[str] = []

    def registration(self, caches: Sequence[torch.Tensor], kv_format: KVFormat) -> Register:
        if kv_format is not KVFormat.TOKEN_MAJOR:
            raise ValueError(
                f"kv_format {kv_format.value!r}: server_driven workers register token_major memory; "
                "use transfer_mode='engine_driven'"
            )
        who = self.who
        layout = describe_caches(caches)
        self.segments = layout.segments
        return Register(
            who.instance_id,
            who.secret,
            who.model_name,
            who.world_size,
            who.worker_id,
            TransferMode.SERVER_DRIVEN,
            layout.memory,
            layout.dtype,
            layout.kv_shape,
            who.owner_pid,
            layout.layers,
        )

    def registered(self, result: Registered | PoolRegistered) -> None:
        return None

    def store(
        self,
        send: Send,
        tokens: np.ndarray,
        blocks: np.ndarray,
        chunk_size: int | None,
        ctx: Key = None,
        names: EngineBlocks | None = None,
        first: int = 0,
    ) -> StoreCounts:
        _whole(first)
        return send(Store(self.who.instance_id, self.who.secret, tokens, blocks, ctx, names))

    def retrieve(
        self,
        send: Send,
        tokens: np.ndarray,
        blocks: np.ndarray,
        chunk_size: int | None,
        ctx: Key = None,
        first: int = 0,
    ) -> int:
        _whole(first)
        msg = Retrieve(self.who.instance_id, self.who.secret, tokens, blocks, ctx)
        return send(msg).retrieved_tokens

    def set_rope(self, params: RopeParams) -> None:
        return None  # the server rotates

    def store_blend(
        self,
        send: Send,
        tokens: np.ndarray,
        blocks: np.ndarray,
        position: int,
        chunk_size: int | None,
        ctx: Key = None,
    ) -> StoreCounts:
        return send(BlendStore(self.who.instance_id, self.who.secret, tokens, blocks, position, ctx))

    def retrieve_blend(
        self,
        send: Send,
        tokens: np.ndarray,
        blocks: np.ndarray,
        position: int,
        chunk_size: int | None,
        ctx: Key = None,
    ) -> BlendHits:
        r = send(BlendRetrieve(self.who.instance_id, self.who.secret, tokens, blocks, position, ctx))
        return list(r.chunks)

    def close(self) -> None:
        return None


def _whole(first: int) -> None:
    if first:
        raise ValueError("server-driven transfers move a prefix from its first chunk (first must be 0)")
