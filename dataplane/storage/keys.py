"""Chunk keys: a prefix-chained hash of token chunks, scoped to one KV layout.

``key_0 = H(scope, tokens[0:C])`` and ``key_i = H(key_{i-1}, tokens[iC:(i+1)C])``: a chunk's key
covers every token before it, so the same chunk text after a different prefix is a different
key. The scope binds the model name, world size, worker id (the tensor-parallel rank: ranks
hold different shards) and the KV layout (dtype, layers, heads, head dim), so two models, two
ranks or two layouts never share a key. A format whose bytes are the same on every rank
(``latent``: multi-head latent attention keeps the whole latent on each rank) is keyed with
neither world size nor rank, so one copy serves every rank of any world size. A token-major
chunk is independent of how the worker pages its memory, so block size and block count are not
in its scope; a chunk of another format
(``dataplane.wire.messages.KVFormat``) holds whole blocks as the engine lays them out, so its
format and block size are.

A request's key context (`dataplane.wire.context.KeyContext`) changes the chain: its salt and
namespace (a LoRA adapter) the start, ``key_0 = H(start, ...)``, and each of its spans the
chunks it overlaps, ``key_i = H(key_{i-1}, tokens[iC:(i+1)C], spans over chunk i)``. Without one,
or with an empty one, keys are as above, so what was shared stays shared.

The tiers file a chunk under its *filing scope* (`filing_scope`: L1's entries, the file tier's
directories, Redis's names): the scope itself for a chunk with no salt and no namespace, else
the scope's first 8 bytes, then 4 bytes of the salt's digest and 4 of the namespace's. Every
chunk of a model's layout and rank so starts with the same 8 bytes, and a `ScopeMatch` finds
them all (a reset after a weight update), or those of one salt, one namespace, or both (the
admin clear of a tenant or an adapter): keys themselves are hashes that name no context.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from dataplane.wire.checks import ID_DTYPE
from dataplane.wire.context import KeyContext
from dataplane.wire.kinds import KVFormat

KEY_BYTES = 16
FAMILY_BYTES = 8  # a filing scope's first bytes: its scope's (`filing_scope`)
PART_BYTES = 4  # then the salt's part, then the namespace's


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
    kv_codec: str = "none",
) -> bytes:
    # a format every rank holds alike is keyed once for all ranks and world sizes
    ranks = "ws=*|rank=*" if KVFormat(kv_format).replicated else f"ws={world_size}|rank={worker_id}"
    text = f"kvwarden/v1|{model_name}|{ranks}|{dtype}|L={num_layers}|H={num_heads}|D={head_dim}"
    if kv_format != "token_major":  # (token-major keys are unchanged from before formats existed)
        text += f"|F={kv_format}|B={block_size}"
    if kv_codec != "none":  # lossy chunks: never served to a worker that did not opt in
        text += f"|Q={kv_codec}"

    return hashlib.blake2b(text.encode(), digest_size=KEY_BYTES).digest()


def context_start(scope: bytes, ctx: KeyContext | None) -> bytes:
    """The chain's start under ``ctx``: the scope itself when it has no salt and no namespace."""
    if ctx is None or not (ctx.salt or ctx.namespace):
        return scope
    h = hashlib.blake2b(scope, digest_size=KEY_BYTES, person=b"kvwarden-ctx")
    for part in (ctx.salt, ctx.namespace):
        h.update(len(part).to_bytes(2, "little"))
        h.update(part)
    return h.digest()


def span_marks(ctx: KeyContext | None, n_chunks: int, chunk_size: int) -> dict[int, bytes]:
    """Chunk index (below ``n_chunks``) -> the encoded spans that overlap it, each with its start
    and end relative to the chunk (so a chunk keys the same in a window of its sequence). The
    spans are sorted and disjoint, so this is linear in spans plus chunks."""
    if ctx is None:
        return {}
    marks: dict[int, bytearray] = {}
    for start, end, digest in ctx.spans:
        if end <= 0:
            continue
        first = max(start, 0) // chunk_size
        if first >= n_chunks:
            break
        tail = bytes([len(digest)]) + digest
        for i in range(first, min((end - 1) // chunk_size + 1, n_chunks)):
            at = i * chunk_size  # where the span starts and ends, relative to the chunk
            enc = (start - at).to_bytes(8, "little", signed=True) + (end - at).to_bytes(
                8, "little", signed=True
            )
            marks.setdefault(i, bytearray(b"\x01")).extend(enc + tail)
    return {i: bytes(m) for i, m in marks.items()}


def _chunks(
    scope: bytes, token_ids: np.ndarray, chunk_size: int, ctx: KeyContext | None
) -> tuple[bytes, list[tuple[memoryview, bytes | None]]]:
    """What both kinds of key hash: the chain's start, and each full chunk's token bytes with
    the spans over it (None: no span)."""
    tokens = np.ascontiguousarray(token_ids, dtype=ID_DTYPE)
    n = len(tokens) // chunk_size
    marks = span_marks(ctx, n, chunk_size) if ctx is not None and ctx.spans else {}
    raw = memoryview(tokens.tobytes())
    step = chunk_size * ID_DTYPE.itemsize
    return context_start(scope, ctx), [(raw[i * step : (i + 1) * step], marks.get(i)) for i in range(n)]


def chunk_keys(
    scope: bytes, token_ids: np.ndarray, chunk_size: int, ctx: KeyContext | None = None
) -> list[bytes]:
    """Keys of every *full* chunk of ``token_ids`` (a trailing partial chunk has no key)."""
    prev, chunks = _chunks(scope, token_ids, chunk_size, ctx)
    keys: list[bytes] = []
    for raw, mark in chunks:
        h = hashlib.blake2b(prev, digest_size=KEY_BYTES)
        h.update(raw)
        if mark is not None:
            h.update(mark)
        prev = h.digest()
        keys.append(prev)
    return keys


def blend_keys(
    scope: bytes, token_ids: np.ndarray, chunk_size: int, ctx: KeyContext | None = None
) -> list[bytes]:
    """A key per full chunk, from the scope (under the request's context) and that chunk's
    tokens alone (and the context's spans over it)."""
    start, chunks = _chunks(scope, token_ids, chunk_size, ctx)
    out = []
    for raw, mark in chunks:
        h = hashlib.blake2b(start, digest_size=KEY_BYTES, person=b"kvwarden-blend")
        h.update(raw)
        if mark is not None:
            h.update(mark)
        out.append(h.digest())
    return out


def _part(scope: bytes, person: bytes, value: bytes) -> bytes:
    return hashlib.blake2b(value, digest_size=PART_BYTES, key=scope, person=person).digest()


def salt_part(scope: bytes, salt: bytes) -> bytes:
    return _part(scope, b"kvwarden-fsalt", salt)


def namespace_part(scope: bytes, namespace: bytes) -> bytes:
    return _part(scope, b"kvwarden-fns", namespace)


def filing_scope(scope: bytes, ctx: KeyContext | None) -> bytes:
    """Where the tiers file the chunks of ``scope`` keyed under ``ctx``: ``scope`` itself without
    a salt or namespace; else its first `FAMILY_BYTES`, the salt's part and the namespace's
    (each a digest keyed by the scope: a salt is never written out)."""
    if ctx is None or not (ctx.salt or ctx.namespace):
        return scope
    return scope[:FAMILY_BYTES] + salt_part(scope, ctx.salt) + namespace_part(scope, ctx.namespace)


@dataclass(frozen=True, slots=True)
class ScopeMatch:
    """Which filing scopes a clear takes (`filing_scope`): those starting with ``head``, and,
    when given, with this salt part and namespace part (a salted or namespaced chunk's)."""

    head: bytes
    salt: bytes | None = None
    namespace: bytes | None = None

    @classmethod
    def whole(cls, scope: bytes) -> ScopeMatch:
        """Every chunk of ``scope``, under every salt and namespace."""
        return cls(scope[:FAMILY_BYTES])

    @classmethod
    def context(cls, scope: bytes, salt: bytes | None, namespace: bytes | None) -> ScopeMatch:
        """The chunks of ``scope`` under salt ``salt`` (None: any) and namespace ``namespace``
        (None: any); at least one of them given, and not both empty (that is no context)."""
        if salt is None and namespace is None:
            raise ValueError("a context needs a salt or a namespace")
        if not salt and not namespace and salt is not None and namespace is not None:
            return cls(scope)  # (chunks with neither are filed under the scope itself)
        return cls(
            scope[:FAMILY_BYTES],
            None if salt is None else salt_part(scope, salt),
            None if namespace is None else namespace_part(scope, namespace),
        )

    @property
    def exact(self) -> bool:
        return len(self.head) == KEY_BYTES

    def matches(self, filed: bytes) -> bool:
        if self.exact:
            return filed == self.head
        if len(filed) != KEY_BYTES or filed[:FAMILY_BYTES] != self.head:
            return False
        at = FAMILY_BYTES
        if self.salt is not None and filed[at : at + PART_BYTES] != self.salt:
            return False
        at += PART_BYTES
        return self.namespace is None or filed[at : at + PART_BYTES] == self.namespace

    def hex_glob(self) -> str:
        """The hex of the filing scopes it matches, as a glob (``?``: any hex digit)."""
        if self.exact or (self.salt is None and self.namespace is None):
            return self.head.hex() + ("" if self.exact else "?" * 2 * (KEY_BYTES - FAMILY_BYTES))
        any_part = "?" * 2 * PART_BYTES
        salt = any_part if self.salt is None else self.salt.hex()
        namespace = any_part if self.namespace is None else self.namespace.hex()
        return self.head.hex() + salt + namespace

    def __str__(self) -> str:
        return self.hex_glob()
