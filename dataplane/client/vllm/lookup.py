"""What the scheduler side of kvwarden's vLLM connector asks the server, without vLLM: the scope
of each KV cache group of the engine (`Scope`, what its workers' ENGINE_REGISTER carries) and
``ScopeLookup``, LOOKUP_SCOPE and PREFETCH_SCOPE for the scheduler, which registers no memory:
how much of a prompt every group of the engine can serve, and how much more is being stored;
and CLEAR_SCOPE, the engine's reset of its cache.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from dataplane.client.channel import Channel, R
from dataplane.client.vllm.wait import LookupFound
from dataplane.memory.kvmemory import TORCH_DTYPES
from dataplane.wire.errors import KVWardenError, RequestError
from dataplane.wire.messages import (
    MAX_WAIT_S,
    ClearScope,
    KeyContext,
    KVFormat,
    LookupScope,
    LookupWaited,
    Message,
    PrefetchScope,
)

logger = logging.getLogger(__name__)

CLEAR_TIMEOUT_S = 60.0  # longest a reset waits for the server to clear one scope (disk, Redis)


@dataclass(frozen=True)
class Scope:
    """What a worker's ENGINE_REGISTER carries, as the scheduler can know it from the config."""

    model_name: str
    world_size: int
    dtype: str
    num_layers: int
    heads: int
    head_dim: int
    kv_format: KVFormat
    block_size: int
    # a sliding-window layer group: the tokens a token sees, itself included (a hit needs only
    # the chunks of the last ``window - 1`` tokens before it); 0: every token before it
    window: int = 0
    # how its chunks are stored ("none", or "int8": quantized, `kvwarden.kv_compression`)
    kv_codec: str = "none"

    def window_chunks(self, chunk_size: int) -> int:
        """The last chunks before a hit's end that the group needs (0: all of them)."""
        return 0 if not self.window else max(1, -(-(self.window - 1) // chunk_size))

    @property
    def token_bytes(self) -> int:
        """KV bytes a token takes in this scope (a rank's share)."""
        itemsize = TORCH_DTYPES[self.dtype].itemsize
        return self.num_layers * self.heads * self.head_dim * self.kv_format.planes * itemsize

    def first_chunk(self, tokens: int, chunk_size: int) -> int:
        """The first chunk a hit of ``tokens`` tokens needs of this group."""
        return 0 if not self.window else max(0, tokens - self.window + 1) // chunk_size


class ScopeLookup:
    """LOOKUP_SCOPE for the scheduler. Never stalls it: a request waits at most ``timeout_s``,
    and after a failure the next ``retry_s`` seconds answer 0 without asking (one WARNING per
    outage, one INFO when answers come back), unless the channel makes a new connection in
    them: a server back from a restart is asked at once (its first answer also teaches the chunk
    size, without which no store is planned). ``_lock`` guards ``chunk_size``, ``_down_until``,
    ``_down_conns`` and ``_down``."""

    def __init__(
        self,
        endpoint: str,
        scope: Scope | tuple[Scope, ...],
        timeout_s: float = 1.0,
        retry_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # one scope a KV cache group of the engine (`dataplane.client.vllm.kinds.scopes_of`)
        self.scopes = scope if isinstance(scope, tuple) else (scope,)
        self.scope = self.scopes[0]
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._clock = clock
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._chan = Channel(self._ctx, endpoint, reconnect_wait_s=min(0.05, timeout_s))
        self._lock = threading.Lock()  # guards chunk_size, _down_until, _down_conns, _down
        self.chunk_size: int | None = None
        self._down_until = 0.0
        self._down_conns = 0  # the channel's connections at the last failure
        self._down = False

    def find(self, token_ids: np.ndarray, key: KeyContext | None = None) -> LookupFound:
        """Tokens of ``token_ids``' prefix that every rank's chunks hold under ``key``, and how
        many more are being stored (nothing, unanswered, when unsure). With several KV cache
        groups: the longest prefix every group can serve, the full-attention groups all of it,
        each sliding-window group the chunks of its window before the prefix's end."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        full = [s for s in self.scopes if not s.window]
        sliding = [s for s in self.scopes if s.window]
        hit = reach = len(tokens)
        l1 = disk = len(tokens)  # (disk: where L1's prefix continued by the file tier's ends)
        for s in full:
            r = self._ask(LookupScope(*self._scope_fields(s), tokens, key, kv_codec=s.kv_codec))
            if r is None:
                return LookupFound(0, 0, answered=False)
            self._learn(r.chunk_size)
            hit, reach, l1 = (
                min(hit, r.hit_tokens),
                min(reach, r.hit_tokens + r.pending_tokens),
                min(l1, r.l1_tokens),
            )
            disk = min(disk, r.l1_tokens + r.fs_tokens)
        if sliding:
            cs = self.chunk_size or self._chunk_size_now(tokens, key)
            if cs is None:
                return LookupFound(0, 0, answered=False)
            if not full:
                hit = reach = len(tokens) // cs * cs
            lowered = True
            while lowered and hit:  # (a lower end needs each window again: it ends elsewhere)
                lowered = False
                for s in sliding:
                    r = self._ask(
                        LookupScope(
                            *self._scope_fields(s), tokens[:hit], key, s.window_chunks(cs), s.kv_codec
                        )
                    )
                    if r is None:
                        return LookupFound(0, 0, answered=False)
                    reach = min(reach, r.hit_tokens + r.pending_tokens)
                    l1 = min(l1, r.l1_tokens)
                    disk = min(disk, r.l1_tokens + r.fs_tokens)
                    if r.hit_tokens < hit:
                        hit, lowered = r.hit_tokens, True
                        if not hit:
                            break
        l1 = min(l1, hit)
        return LookupFound(hit, max(0, reach - hit), l1=l1, fs=max(0, min(disk, hit) - l1))

    def _learn(self, chunk_size: int) -> None:
        with self._lock:
            self.chunk_size = chunk_size

    def _chunk_size_now(self, tokens: np.ndarray, key: KeyContext | None) -> int | None:
        """The server's chunk size, asked with a lookup of no window (a sliding-window group's
        window is counted in chunks)."""
        r = self._ask(
            LookupScope(*self._scope_fields(self.scope), tokens[:0], key, kv_codec=self.scope.kv_codec)
        )
        if r is not None:
            self._learn(r.chunk_size)
        return None if r is None else r.chunk_size

    def prefetch(self, token_ids: np.ndarray, key: KeyContext | None = None) -> None:
        """PREFETCH_SCOPE, for each group: the server starts bringing the prefix its slower
        tiers hold into L1 (a sliding-window group's window before the prompt's end). Nothing is
        sent while resting after a failure; a failure is one more outage."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        cs = self.chunk_size
        for s in self.scopes:
            if s.window and cs is None:
                continue
            window = s.window_chunks(cs) if s.window and cs is not None else 0
            self._ask(PrefetchScope(*self._scope_fields(s), tokens, key, window, s.kv_codec))

    def _ask(self, msg: Message[R]) -> R | None:
        """``msg``'s reply; None, unasked, while resting after a failure, or when it fails (one
        more outage). A request the server refuses raises: a bug to see, not an outage."""
        if self._resting():
            return None
        try:
            reply = self._chan.request(msg, self.timeout_s)
        except RequestError:
            raise
        except KVWardenError as exc:
            self._failed(exc)
            return None
        with self._lock:
            back, self._down = self._down, False
        if back:
            logger.info("kvwarden: lookups answered again")
        return reply

    def _scope_fields(self, scope: Scope | None = None) -> tuple[str, int, str, int, int, int, KVFormat, int]:
        s = self.scope if scope is None else scope
        return (
            s.model_name,
            s.world_size,
            s.dtype,
            s.num_layers,
            s.heads,
            s.head_dim,
            s.kv_format,
            s.block_size,
        )

    def clear(self, timeout_s: float = CLEAR_TIMEOUT_S) -> bool:
        """CLEAR_SCOPE for each group's scope: every chunk of this engine's scopes leaves every
        tier of the server (a reset: the weights changed). True only when the server answers
        that nothing is left of any; asked even while resting after a failure (a reset must
        not pass unasked), waiting at most ``timeout_s`` each (the disk's and Redis's time)."""
        ok = True
        for s in self.scopes:
            try:
                r = self._chan.request(ClearScope(*self._scope_fields(s), s.kv_codec), timeout_s)
            except KVWardenError as exc:
                logger.warning("kvwarden: the reset of %s's cache failed: %s", s.model_name, exc)
                return False
            if not r.complete:
                what = f"failed: {', '.join(r.failed)}" if r.failed else f"{r.pinned} chunks held by a reader"
                logger.warning("kvwarden: the reset of %s's cache is incomplete (%s)", s.model_name, what)
            ok = ok and r.complete
            logger.info(
                "kvwarden: reset of %s's cache: %d chunks removed (L1 %d, files %d, remote %d)",
                s.model_name, r.l1 + r.fs + r.remote, r.l1, r.fs, r.remote,
            )  # fmt: skip
        return ok

    def hit_tokens(self, token_ids: np.ndarray, key: KeyContext | None = None) -> int:
        return self.find(token_ids, key).hit

    def report_wait(self, waited_s: float, outcome: str) -> None:
        """Tell the server how a wait ended (its /metrics); an outage loses the report."""
        if self._resting():
            return
        try:
            self._chan.request(LookupWaited(min(waited_s, MAX_WAIT_S), outcome), self.timeout_s)
        except RequestError:
            raise
        except KVWardenError as exc:
            self._failed(exc)

    def _resting(self) -> bool:
        """Whether the server is not asked now: within ``retry_s`` of a failure, and no new
        connection since."""
        with self._lock:
            if self._clock() >= self._down_until:
                return False
            conns = self._down_conns
        if self._chan.poll_connections() == conns:
            return True
        with self._lock:
            self._down_until = 0.0  # a new connection: the server is back, ask it
        return False

    def _failed(self, exc: KVWardenError) -> None:
        conns = self._chan.connections
        with self._lock:
            self._down_until = self._clock() + self.retry_s
            self._down_conns = conns
            first, self._down = not self._down, True
        if first:
            logger.warning("kvwarden: lookups answer 0 (recompute) until the server is back: %s", exc)

    def close(self) -> None:
        self._chan.close()
        self._ctx.term()
