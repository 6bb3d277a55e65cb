"""Key contexts, as a client builds them: what a request's KV depends on beyond its token ids.

    ctx = key_context(salt="tenant-a", adapter=adapter_namespace("sql", "/adapters/sql"),
                      spans=mm_spans([("img-3f2a", 5, 576)]))
    w.store(tokens, blocks, ctx); w.lookup(tokens, ctx); w.retrieve(tokens, blocks, ctx)

A chunk stored under one context is found only under the same one (`dataplane.wire.context`).
What goes in, the way vLLM's own prefix cache keys its blocks:

- the tenant's salt (``cache_salt``), as it is;
- a LoRA adapter: its name, its path and a digest of the files in that directory (its weights
  and configuration), so an adapter reloaded in place under the same name and path is another
  adapter (``adapter_namespace``; the digest is cached by the files' size, time and inode);
- each multimodal input: its identifier over the tokens of its placeholder (``mm_spans``);
- prompt embeddings: a digest of each block's embeddings over that block (``embeds_spans``).

Anything a caller cannot name this way must not be cached: `UninterpretableKey`.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from dataplane.wire.context import KeyContext, Span, salt_bytes


class UninterpretableKey(ValueError):
    """The request's KV depends on something no key context can name: never cache it."""


def key_context(
    salt: str | bytes | None = None, adapter: bytes = b"", spans: Iterable[Span] = ()
) -> KeyContext | None:
    """The context of a request (None when it changes no key: tokens alone key its chunks)."""
    ctx = KeyContext(salt_bytes(salt), adapter, merge_spans(spans))
    return ctx if ctx else None


# ------------------------------------------------------------------------------------- adapters

_DIGESTS: dict[tuple[str, tuple[tuple[str, int, int, int], ...]], bytes] = {}
_digest_lock = threading.Lock()  # guards _DIGESTS


def _files_of(path: Path) -> tuple[tuple[str, int, int, int], ...]:
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
    except OSError as exc:
        raise UninterpretableKey(f"adapter path {str(path)!r} cannot be read: {exc.strerror}") from None
    out = []
    for e in entries:
        if e.is_file():
            st = e.stat()
            out.append((e.name, st.st_size, st.st_mtime_ns, st.st_ino))
    if not any(name.endswith((".safetensors", ".bin", ".pt")) for name, *_ in out):
        raise UninterpretableKey(f"adapter path {str(path)!r} holds no weights file")
    return tuple(out)


def weights_digest(path: str | os.PathLike[str]) -> bytes:
    """A digest of every file directly in the adapter's directory (its weights and config),
    recomputed only when one of them changes (size, modification time or inode)."""
    p = Path(path)
    files = _files_of(p)
    cache_key = (str(p.resolve()), files)
    with _digest_lock:
        hit = _DIGESTS.get(cache_key)
    if hit is not None:
        return hit
    h = hashlib.blake2b(digest_size=32, person=b"kvwarden-lora")
    for name, *_ in files:
        h.update(name.encode() + b"\0")
        with open(p / name, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
    digest = h.digest()
    if _files_of(p) != files:  # changed while it was read: the next call reads it again
        return digest
    with _digest_lock:
        _DIGESTS[cache_key] = digest
    return digest


def adapter_namespace(name: str, path: str | os.PathLike[str]) -> bytes:
    """A LoRA adapter's identity: its name, its path and the digest of its files."""
    h = hashlib.blake2b(digest_size=32, person=b"kvwarden-lora")
    for part in (name.encode(), os.fsencode(path), weights_digest(path)):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return b"lora:" + h.digest()


# ---------------------------------------------------------------------------------------- spans


def mm_spans(items: Iterable[tuple[str, int, int]]) -> list[Span]:
    """``(identifier, offset, length)`` of each multimodal input -> its span of tokens."""
    out = []
    for ident, offset, length in items:
        if not ident or length <= 0 or offset < 0:
            raise UninterpretableKey(f"multimodal input {ident!r} at {offset}+{length} cannot be keyed")
        out.append((offset, offset + length, hashlib.blake2b(ident.encode(), digest_size=32).digest()))
    return out


def embeds_spans(embeds: torch.Tensor, block: int) -> list[Span]:
    """A digest of each ``block`` tokens' prompt embeddings, over those tokens."""
    data = embeds.detach().to("cpu").contiguous()
    flat = data.view(torch.uint8).reshape(data.shape[0], -1) if data.dim() > 1 else data.view(torch.uint8)
    out = []
    for start in range(0, data.shape[0], block):
        end = min(start + block, data.shape[0])
        digest = hashlib.sha256(flat[start:end].numpy().tobytes()).digest()
        out.append((start, end, digest))
    return out


def merge_spans(spans: Iterable[Span]) -> tuple[Span, ...]:
    """Sorted, disjoint spans covering what ``spans`` cover: where two overlap (a multimodal
    input over embeddings), each piece carries a digest of every span over it."""
    items = sorted(spans)
    if all(a[1] <= b[0] for a, b in itertools.pairwise(items)):
        return tuple(items)
    cuts = sorted({x for s, e, _ in items for x in (s, e)})
    out: list[Span] = []
    for lo, hi in itertools.pairwise(cuts):
        over: Sequence[Span] = [sp for sp in items if sp[0] < hi and sp[1] > lo]
        if over:
            h = hashlib.blake2b(digest_size=32)
            for s, e, d in over:
                h.update(s.to_bytes(8, "little", signed=True) + e.to_bytes(8, "little", signed=True) + d)
            out.append((lo, hi, h.digest()))
    return tuple(out)
