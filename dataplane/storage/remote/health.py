"""The remote tier's health calls (`RemoteBackend.ping`, `RemoteBackend.probe`), made through a
client of their own: bounded by the health timeout, and never queued behind the data path's
connections. Refused credentials raise `RemoteAuthError`: retrying cannot help."""

from __future__ import annotations

import os

import redis

from dataplane.storage.lower import OK, OTHER_ERROR, TIMEOUT, WriteSpace
from dataplane.storage.remote.redis_client import Lazy, failure_kind, ping_all, room


class RemoteAuthError(RuntimeError):
    """Redis refused the credentials: retrying cannot help."""


def ping_code(health: Lazy, url: str, prefix: str, space: WriteSpace) -> int:
    """PING (every primary of a cluster): 0 ok, -1 timeout, -2 any other error. While writes
    are stopped for want of space, a PING answered also asks whether there is room again."""
    try:
        ping_all(health())
        if space.out:
            _retry_space(health, prefix, space)
    except redis.RedisError as exc:
        kind = failure_kind(exc)
        if kind == "auth":
            raise RemoteAuthError(f"{url}: the server refused the credentials") from None
        return TIMEOUT if kind == "timeout" else OTHER_ERROR
    return OK


def probe(health: Lazy, url: str, prefix: str, space: WriteSpace) -> bool:
    """Put random bytes under a probe key, read them back: True when they round-trip equal
    (the key expires after a minute). A Redis that answers OOM answers: True, and writes stop
    (``space``)."""
    key, data = f"{prefix}probe:{os.urandom(8).hex()}", os.urandom(64)
    try:
        health().set(key, data, px=60_000)
        back = health().get(key)
        health().delete(key)
    except redis.RedisError as exc:
        kind = failure_kind(exc)
        if kind == "auth":
            raise RemoteAuthError(f"{url}: the server refused the credentials") from None
        if kind == "no_space":
            space.ran_out("OOM on the probe key")
            return True
        return False
    return back == data


def _retry_space(health: Lazy, prefix: str, space: WriteSpace) -> None:
    """Writes resume once Redis has room for the write that failed (``INFO memory``; where
    it does not say, as on a server that refuses INFO, the probe alone decides) and takes a
    probe key. Whatever fails here leaves writes stopped, and never the PING."""
    client = health()
    left = room(client)
    if left is not None and left < max(space.need(), 1):
        return
    key = f"{prefix}probe:{os.urandom(8).hex()}"
    try:
        client.set(key, b"room", px=60_000)
        client.delete(key)
    except redis.RedisError:
        return
    space.freed("Redis has room again" if left is None else f"Redis has {left} bytes of room")
