"""A router's lookup (`POST /v1/lookup`): how many prefix tokens of a prompt each tier holds, for
a model named as its workers register it, under a tenant's salt and a LoRA adapter's name.

The scopes asked about are those of the instances registered for the model since start (the
chunks outlive their workers), grouped by world size; a prefix counts only as far as every rank
of a group holds it, and the group holding most answers. Nothing is touched (no LRU refresh, no
read-ahead): L1 is read under its lock, the file tier through its index and a ``stat`` for what
that lacks (on its I/O threads, within its deadline), the remote tier in one pipelined round
trip. A salted prefix is found only under its salt; an adapter's only under the name its stores
gave it. Called on the sidecar's threads, never the loop's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dataplane.liveness.registry import LivenessRegistry
from dataplane.storage.keys import chunk_keys, filing_scope
from dataplane.storage.tiered import TieredStore
from dataplane.wire.context import KeyContext, salt_bytes

MAX_LOOKUP_TOKENS = 1 << 20  # of one prompt (the sidecar bounds a batch)


@dataclass(frozen=True, slots=True)
class TierHits:
    """Prefix tokens held: in L1 (``cpu``), in the file tier (``disk``), in the remote tier
    (``external``), each from the first token, and ``total``, what a RETRIEVE would bring (L1's
    prefix continued by the file tier, then the remote tier). ``known``: instances of the model
    have registered since start (else all 0)."""

    tokens: int
    chunk_size: int
    cpu: int
    disk: int
    external: int
    total: int
    known: bool


def lookup_tiers(
    l1: TieredStore,
    registries: Sequence[LivenessRegistry],  # type: ignore[type-arg]
    chunk_size: int,
    model: str,
    token_ids: np.ndarray,
    salt: str | None = None,
    adapter: str | None = None,
) -> TierHits:
    scopes: set[tuple[int, int, bytes]] = set()
    for r in registries:
        scopes |= r.scopes_of(model)
    none = TierHits(len(token_ids), chunk_size, 0, 0, 0, 0, bool(scopes))
    namespace = b""
    if adapter is not None:
        found = l1.names.namespace(adapter)
        if found is None:
            return none  # nothing was ever stored under that adapter's name
        namespace = found
    if not scopes or not l1.gate():
        return none
    raw = salt_bytes(salt)
    ctx = KeyContext(raw, namespace) if raw or namespace else None
    groups: dict[int, list[bytes]] = {}
    for world, _, scope in sorted(scopes):
        groups.setdefault(world, []).append(scope)
    best = (0, 0, 0, 0)
    for members in groups.values():
        counts = [
            _counts(l1, filing_scope(scope, ctx), chunk_keys(scope, token_ids, chunk_size, ctx))
            for scope in members
        ]
        cpu, disk, ext, total = (min(c[i] for c in counts) for i in range(4))
        best = max(best, (cpu, disk, ext, total), key=lambda c: (c[3], c))
    cpu, disk, external, total = (n * chunk_size for n in best)
    return TierHits(len(token_ids), chunk_size, cpu, disk, external, total, True)


def lookup_hashes(
    l1: TieredStore, chunk_size: int, model: str, hashes: Sequence[int], block_size: int
) -> TierHits:
    """As `lookup_tiers`, for a prompt named by the engine's block hashes (``block_size`` tokens
    each, from the first): its chunks are those stores named so (`NameBook`); the salt and the
    adapter are in the hashes."""
    tokens = len(hashes) * block_size
    none = TierHits(tokens, chunk_size, 0, 0, 0, 0, False)
    if chunk_size % block_size or not l1.gate():
        return none
    scope, keys = l1.names.chunks(model, hashes, chunk_size // block_size)
    if not keys:
        return none
    cpu, disk, external, total = (n * chunk_size for n in _counts(l1, scope, keys))
    return TierHits(tokens, chunk_size, cpu, disk, external, total, True)


def _counts(l1: TieredStore, scope: bytes, keys: list[bytes]) -> tuple[int, int, int, int]:
    """(L1's prefix, the file tier's, the remote tier's, and L1's continued by the file tier's,
    then the remote tier's, as a LOOKUP counts), in chunks."""
    cpu = l1.peek_prefix(keys)
    fs, remote = l1.fs, l1.remote
    disk = fs.held(scope, keys) if fs is not None else 0
    external = remote.count_prefix(keys, scope=scope) if remote is not None and not remote.bypassed else 0
    total = cpu
    if fs is not None and total < len(keys):
        total = disk if disk >= total else total + fs.held(scope, keys[total:])
    if remote is not None and not remote.bypassed and total < len(keys):
        total = external if external >= total else total + remote.count_prefix(keys[total:], scope=scope)
    return cpu, disk, external, total
