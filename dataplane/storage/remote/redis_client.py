"""Redis clients for the remote tier: a standalone server (``redis://``, ``rediss://``) or a
Redis Cluster (``redis+cluster://host:port[,host:port...]``), made with one try per call (no
retries: the bound is the timeout), made lazily (`Lazy`); URLs shown without their password
(`redact`); failures sorted into kinds (`failure_kind`); the room Redis has left (`room`)."""

from __future__ import annotations

import re
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any

import redis
from redis import exceptions as rexc
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

CLUSTER_SCHEME = "redis+cluster://"
Client = redis.Redis | RedisCluster


def redact(url: str) -> str:
    """``url`` without a password (the user name is kept)."""
    return _PASSWORD.sub(r"://\1:***@", url, count=1)


_PASSWORD = re.compile(r"://([^:@/]*):[^@/]*@")


def failure_kind(exc: BaseException) -> str:
    if isinstance(exc, rexc.AuthenticationError | rexc.AuthorizationError | rexc.NoPermissionError):
        return "auth"
    if isinstance(exc, redis.TimeoutError | TimeoutError):
        return "timeout"
    if isinstance(exc, redis.ConnectionError | ConnectionError | OSError):
        return "connection"
    if isinstance(exc, rexc.OutOfMemoryError):  # maxmemory reached, noeviction: out of space
        return "no_space"
    return "error"


def make_client(url: str, password: str | None, timeout_s: float) -> Client:
    common: dict[str, Any] = {
        "password": password,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),  # one try: the bound is the timeout, not a multiple of it
        "client_name": "kvwarden",
    }
    if url.startswith(CLUSTER_SCHEME):
        user, nodes = parse_cluster_url(url)
        if user is not None:
            common["username"], common["password"] = user[0] or None, password or user[1]
        try:  # the cluster client asks a node for the slot map at once
            seeds = [ClusterNode(h, p) for h, p in nodes]  # type: ignore[no-untyped-call]
            return RedisCluster(startup_nodes=seeds, **common)
        except rexc.RedisError:
            raise
        except Exception as exc:  # RedisClusterException is not a RedisError
            raise redis.ConnectionError(f"cluster unreachable: {type(exc).__name__}") from None
    return redis.Redis.from_url(url, retry_on_error=[], health_check_interval=0, **common)


def parse_cluster_url(url: str) -> tuple[tuple[str, str] | None, list[tuple[str, int]]]:
    """(user and password, or None; the seed nodes) of ``redis+cluster://[u:p@]h:p[,h:p...]``.
    ValueError naming the problem."""
    rest = url[len(CLUSTER_SCHEME) :].rstrip("/")
    user = None
    if "@" in rest:
        cred, rest = rest.rsplit("@", 1)
        name, _, pw = cred.partition(":")
        user = (urllib.parse.unquote(name), urllib.parse.unquote(pw))
    nodes = []
    for part in rest.split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{part!r} is not host:port (redis+cluster://host:port[,host:port...])")
        nodes.append((host.strip("[]"), int(port)))
    return user, nodes


class Lazy:
    """A client made on first use (and made again after that failed): a cluster client asks
    for the slot map when made, and a server must start while its cluster is away."""

    def __init__(self, make: Callable[[], Client]) -> None:
        self._make = make
        # leaf: guards _made; held while a client is made (a connect bounded by the timeout)
        self._lock = threading.Lock()
        self._made: Client | None = None

    def __call__(self) -> Client:
        made = self._made
        if made is None:
            with self._lock:
                if self._made is None:
                    self._made = self._make()
                made = self._made
        return made

    def close(self) -> None:
        with self._lock:
            made, self._made = self._made, None
        if made is not None:
            made.close()


def ping_all(client: Client) -> None:
    """PING the server, or every primary of a cluster (RedisError when one does not answer)."""
    if isinstance(client, RedisCluster):
        client.ping(target_nodes=RedisCluster.PRIMARIES)
    else:
        client.ping()


def room(client: Client) -> int | None:
    """Bytes Redis may still take before ``maxmemory`` (the least over a cluster's nodes; None:
    no limit, or it does not say: INFO refused, or no answer)."""
    try:
        info: Any = client.info("memory")
    except Exception:  # (also a cluster that answers INFO otherwise)
        return None
    nodes = [info] if "used_memory" in info else [v for v in info.values() if isinstance(v, dict)]
    left = [
        int(n["maxmemory"]) - int(n["used_memory"])
        for n in nodes
        if int(n.get("maxmemory", 0) or 0) > 0 and "used_memory" in n
    ]
    return min(left) if left else None
