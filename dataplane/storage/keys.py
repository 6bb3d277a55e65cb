"""Chunk keys: a prefix-chained hash of token chunks, scoped to one KV layout.

``key_0 = H(scope, tokens[0:C])`` and ``key_i = H(key_{i-1}, tokens[iC:(i+1)C])``: a chunk's key
covers every token before it, so the same chunk text after a different prefix is a different
key. The scope binds the model name, world size, worker id (the tensor-parallel rank: ranks
hold different shards) and the KV layout (dtype, layers, heads, head dim), so two models, two
ranks or two layouts never share a key. A token-major chunk is independent of how the worker
pages its memory, so block size and block count are not in its scope; a chunk of another format
(``dataplane.wire.messages.KVFormat``) holds whole blocks as the engine lays them out, so its
format and block size are.
"""

from __future__ import annotations

import hashlib

import numpy as np

from dataplane.wire.checks import ID_DTYPE

KEY_BYTES = 16


def scope_digest(
    model_name: str,
    world_size: int,
    worker_id: int,
    dtype: str,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    kv_format: str = "token_major",
    block_size: int = 0,
) -> bytes:
    text = (
        f"kvwarden/v1|{model_name}|ws={world_size}|rank={worker_id}|{dtype}|"
        f"L={num_layers}|H={num_heads}|D={head_dim}"
    )
    if kv_format != "token_major":  # (token-major keys are unchanged from before formats existed)
        text += f"|F={kv_format}|B={block_size}"

    return hashlib.blake2b(text.encode(), digest_size=KEY_BYTES).digest()


def chunk_keys(scope: bytes, token_ids: np.ndarray, chunk_size: int) -> list[bytes]:
    """Keys of every *full* chunk of ``token_ids`` (a trailing partial chunk has no key)."""
    tokens = np.ascontiguousarray(token_ids, dtype=ID_DTYPE)
    n_full = len(tokens) // chunk_size
    keys: list[bytes] = []
    prev = scope
    raw = memoryview(tokens.tobytes())
    step = chunk_size * ID_DTYPE.itemsize
    for i in range(n_full):
        h = hashlib.blake2b(prev, digest_size=KEY_BYTES)
        h.update(raw[i * step : (i + 1) * step])
        prev = h.digest()
        keys.append(prev)
    return keys
