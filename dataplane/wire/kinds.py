"""The wire's enumerations: message types, memory kinds, KV formats, transfer modes
(re-exported by `dataplane.wire.messages`, where the records that carry them live)."""

from __future__ import annotations

import enum


class MsgType(enum.StrEnum):
    HELLO = "HELLO"
    GET_SERVER_INFO = "GET_SERVER_INFO"
    PING = "PING"
    REGISTER_KV_CACHE = "REGISTER_KV_CACHE"
    UNREGISTER_KV_CACHE = "UNREGISTER_KV_CACHE"
    STORE = "STORE"
    RETRIEVE = "RETRIEVE"
    LOOKUP = "LOOKUP"
    LOOKUP_SCOPE = "LOOKUP_SCOPE"
    LOOKUP_WAITED = "LOOKUP_WAITED"
    PREFETCH_SCOPE = "PREFETCH_SCOPE"
    CLEAR_SCOPE = "CLEAR_SCOPE"
    ENGINE_REGISTER = "ENGINE_REGISTER"
    ENGINE_STORE = "ENGINE_STORE"
    ENGINE_RETRIEVE = "ENGINE_RETRIEVE"
    ENGINE_RESERVE = "ENGINE_RESERVE"
    ENGINE_COMMIT = "ENGINE_COMMIT"
    ENGINE_ACQUIRE = "ENGINE_ACQUIRE"
    ENGINE_RELEASE = "ENGINE_RELEASE"
    BLEND_REGISTER = "BLEND_REGISTER"
    BLEND_STORE = "BLEND_STORE"
    BLEND_RETRIEVE = "BLEND_RETRIEVE"
    BLEND_RESERVE = "BLEND_RESERVE"
    BLEND_ACQUIRE = "BLEND_ACQUIRE"


class MemoryKind(enum.StrEnum):
    SHM = "shm"
    CUDA_IPC = "cuda_ipc"


class KVFormat(enum.StrEnum):
    """What a chunk's bytes are: the engine's own layout of a block's KV, moved as is. A chunk is
    only ever served to a worker of the same format (it is part of the key scope)."""

    # per layer: K of every token, then V, each [tokens, heads * head_dim] (vLLM on CUDA)
    TOKEN_MAJOR = "token_major"
    # per layer and block: per head K transposed [head_dim][block_size], then V
    # [block_size][head_dim] (vLLM's CPU backend); moves in whole blocks only
    VLLM_CPU = "vllm_cpu"
    # vLLM's CPU backend where its attention runs on AMX tiles (bfloat16, blocks of a multiple of
    # 32): per layer, block and head, K as [head_dim / 2][block_size][2] (pairs of channels),
    # then V as [block_size / 2][head_dim][2] (pairs of tokens); the same bytes read as
    # `VLLM_CPU` would be other KV, so the two never share a chunk
    VLLM_CPU_AMX = "vllm_cpu_amx"
    # per layer and block: one latent vector a token, [block_size][head_dim] (multi-head latent
    # attention: DeepSeek's compressed KV and its rotary key, registered as one head); the same
    # on every tensor-parallel rank; moves in whole blocks only
    LATENT = "latent"

    @property
    def planes(self) -> int:
        """Vectors a token and head: K and V (2), or one latent (1)."""
        return 1 if self is KVFormat.LATENT else 2

    @property
    def replicated(self) -> bool:
        """Every tensor-parallel rank holds the same bytes: one copy is keyed for all ranks."""
        return self is KVFormat.LATENT


class TransferMode(enum.StrEnum):
    SERVER_DRIVEN = "server_driven"  # the server maps the worker's memory and copies
    ENGINE_DRIVEN = "engine_driven"  # the worker copies through a pool the server owns
