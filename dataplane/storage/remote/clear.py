"""Clearing a scope of the remote tier (`RemoteBackend.clear_scope`): the names of the chunks,
``<prefix><filing scope hex>:<key hex>``, are found by SCAN with MATCH ``<prefix, glob-escaped>
<the scopes' hex glob>:*`` (`dataplane.storage.keys.ScopeMatch`; on every primary of a cluster)
and UNLINKed in pipelined batches, one UNLINK a name, so that which names each batch removed is
known."""

from __future__ import annotations

from collections.abc import Iterator

from dataplane.storage.keys import ScopeMatch
from dataplane.storage.remote.redis_client import Client

BATCH = 1000  # SCAN's COUNT, and the names UNLINKed per round trip


def glob_escape(text: str) -> str:
    """``text`` matched literally by a Redis glob pattern (MATCH)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def unlink_scope(client: Client, prefix: str, scope: ScopeMatch) -> Iterator[tuple[int, list[bytes]]]:
    """UNLINK every name under ``prefix`` whose filing scope ``scope`` matches, a batch at a
    time: per batch, how many names it removed and the chunk keys among them (a name whose tail
    is not a key's hex, set by some other program, is removed and counted, but has no key).
    Raises what Redis raises (`redis.RedisError`), after yielding the batches removed before it."""
    glob = scope.hex_glob()
    skip = len((prefix + glob + ":").encode())
    batch: list[bytes] = []
    for name in client.scan_iter(match=glob_escape(prefix) + glob + ":*", count=BATCH):
        batch.append(name)
        if len(batch) >= BATCH:
            yield _unlink(client, batch, skip)
            batch = []
    if batch:
        yield _unlink(client, batch, skip)


def _unlink(client: Client, names: list[bytes], skip: int) -> tuple[int, list[bytes]]:
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.unlink(name)
    gone = [name for name, n in zip(names, pipe.execute(), strict=True) if n]
    keys = []
    for name in gone:
        try:
            keys.append(bytes.fromhex(name[skip:].decode("ascii")))
        except ValueError:  # (not a chunk's name: its tail is not hex)
            continue
    return len(gone), keys
