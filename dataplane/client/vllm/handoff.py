"""A disaggregated prefill's handoff through vLLM's ``kv_transfer_params``: the producer's finished
request names what it stored (`produced`), and the consumer given those params waits, within its
bound, for exactly that prefix (`expected`) instead of recomputing what has not landed yet.

The params travel through the proxy and the client: they carry a digest of the request's key
context (never its salt), the prompt tokens stored and the server they were stored to. A
consumer counts on them only for a request of the same key context; anything malformed or
foreign is ignored (the request is looked up as any other).
"""

from __future__ import annotations

import hashlib
from typing import Any

from dataplane.wire.context import KeyContext

PARAMS_KEY = "kvwarden"
MAX_TOKENS = 1 << 31


def key_digest(key: KeyContext | None) -> str:
    """A digest of a key context (salt, adapter namespace, spans): equal for equal contexts."""
    h = hashlib.blake2b(digest_size=16, person=b"kvwarden-handoff")
    if key is not None:
        for part in (key.salt, key.namespace):
            h.update(len(part).to_bytes(4, "little"))
            h.update(part)
        for start, end, digest in key.spans:
            h.update(start.to_bytes(8, "little", signed=True))
            h.update(end.to_bytes(8, "little", signed=True))
            h.update(len(digest).to_bytes(2, "little"))
            h.update(digest)
    return h.hexdigest()


def produced(tokens: int, key: KeyContext | None, server: str) -> dict[str, Any]:
    """The ``kv_transfer_params`` a producer's finished request returns."""
    return {PARAMS_KEY: {"tokens": tokens, "key": key_digest(key), "server": server}}


def expected(params: Any, key: KeyContext | None) -> int:
    """The prompt tokens a producer said it stored, for a request of key context ``key`` given
    ``params`` (its ``kv_transfer_params``); 0 when there are none, or they are malformed, or
    of another key context."""
    if not isinstance(params, dict):
        return 0
    mine = params.get(PARAMS_KEY)
    if not isinstance(mine, dict):
        return 0
    tokens = mine.get("tokens")
    if type(tokens) is not int or not 0 <= tokens < MAX_TOKENS or mine.get("key") != key_digest(key):
        return 0
    return tokens
