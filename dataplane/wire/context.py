"""A request's key context: what its KV depends on, and who may see it, beyond its token ids.

Two requests with the same tokens compute different KV under different LoRA adapters, multimodal
inputs or prompt embeddings (whose positions all hold one placeholder id), and a tenant's prefix
must not be served to, or timed by, another tenant. Every message that names tokens carries an
optional ``KeyContext``; the server folds it into the chunk keys (`dataplane.storage.keys`):

- ``salt``: the tenant's secret (vLLM's ``cache_salt``): folded into the start of the chain, so
  every chunk under it differs from the same tokens under another salt or none. The server never
  shows it: its tenant label is a keyed digest.
- ``namespace``: what applies to every token (a LoRA adapter's identity: name, path and a
  digest of its weights), folded into the start of the chain as well.
- ``spans``: ``(start, end, digest)`` token ranges with content of their own (a multimodal
  input's identifier, a block of prompt embeddings): folded into every chunk the range overlaps,
  with where it starts and ends relative to that chunk, and through the chain into every later
  one. Sorted, not overlapping; a start may be negative (a range that began before the tokens a
  request names: blend requests name a window of a longer sequence, `KeyContext.window`).

A request without a context (``None``), or with an empty one, keys its chunks on tokens alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Annotated, Any

from dataplane.wire.checks import blob, type_name, wire_type
from dataplane.wire.errors import ProtocolError
from dataplane.wire.records import Record, decode_record

MAX_SALT_BYTES = 256
MAX_NAMESPACE_BYTES = 256
MAX_SPANS = 1 << 16
MAX_SPAN_DIGEST_BYTES = 64
MAX_SPAN_END = 1 << 21  # MAX_TOKENS_PER_REQUEST

Span = tuple[int, int, bytes]


@wire_type(f"array of at most {MAX_SPANS} [int, int, bin of 1 to {MAX_SPAN_DIGEST_BYTES} bytes]")
def _spans(v: Any, where: str) -> tuple[Span, ...]:
    if not isinstance(v, list):
        raise ProtocolError(f"{where}: expected an array of [start, end, digest], got {type_name(v)}")
    if len(v) > MAX_SPANS:
        raise ProtocolError(f"{where}: {len(v)} spans exceeds the limit of {MAX_SPANS}")
    out: list[Span] = []
    prev_end = -MAX_SPAN_END
    for i, item in enumerate(v):
        at = f"{where}[{i}]"
        if not isinstance(item, list) or len(item) != 3:
            raise ProtocolError(f"{at}: expected [start, end, digest], got {type_name(item)}")
        start, end, digest = item
        if type(start) is not int or type(end) is not int:
            raise ProtocolError(f"{at}: start and end must be integers")
        if not -MAX_SPAN_END <= start < end <= MAX_SPAN_END:
            raise ProtocolError(
                f"{at}: [{start}, {end}) is not a range inside [-{MAX_SPAN_END}, {MAX_SPAN_END}]"
            )
        if start < prev_end:
            raise ProtocolError(
                f"{at}: starts at {start}, inside or before the span before it (ends {prev_end})"
            )
        if not isinstance(digest, bytes) or not 0 < len(digest) <= MAX_SPAN_DIGEST_BYTES:
            raise ProtocolError(f"{at}: digest must be 1 to {MAX_SPAN_DIGEST_BYTES} bytes")
        out.append((start, end, digest))
        prev_end = end
    return tuple(out)


@dataclasses.dataclass(frozen=True, slots=True)
class KeyContext(Record):
    salt: Annotated[
        bytes,
        blob(MAX_SALT_BYTES),
        "the tenant's secret (vLLM's cache_salt): only requests with the same salt share chunks",
    ] = b""
    namespace: Annotated[
        bytes, blob(MAX_NAMESPACE_BYTES), "what applies to every token: a LoRA adapter's identity"
    ] = b""
    spans: Annotated[
        tuple[Span, ...],
        _spans,
        "[start, end, digest] ranges with content of their own (multimodal inputs), sorted, apart",
    ] = ()

    def __bool__(self) -> bool:
        """False when it changes no key (the chunks are keyed on tokens alone)."""
        return bool(self.salt or self.namespace or self.spans)

    def window(self, offset: int) -> KeyContext:
        """The context of the tokens from ``offset`` on (spans that end before it dropped, the
        rest shifted): each chunk of the window keys as it does in the whole sequence."""
        if not self.spans or not offset:
            return self
        spans = tuple((s - offset, e - offset, d) for s, e, d in self.spans if e > offset)
        return dataclasses.replace(self, spans=spans)


def salt_bytes(salt: str | bytes | None) -> bytes:
    """A tenant's salt as chunk keys fold it in (vLLM's ``cache_salt`` is a str): a salt longer
    than `MAX_SALT_BYTES` is hashed, not cut, so two long salts stay two tenants."""
    raw = salt.encode() if isinstance(salt, str) else (salt or b"")
    if len(raw) > MAX_SALT_BYTES:
        raw = b"salt-digest:" + hashlib.blake2b(raw, digest_size=32).digest()
    return raw


@wire_type("`KeyContext` or nil")
def opt_key_context(v: Any, where: str) -> KeyContext | None:
    """A message's ``key`` field: nil, or ``[salt, namespace, spans]``."""
    return None if v is None else decode_record(KeyContext, v, where)
