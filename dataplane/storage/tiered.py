"""TieredStore: L1 first, then the file tier, then the remote tier, behind the health gate; what
the modules use.

A subclass of the L1 store (`L1Store`): the modules call it through L1's interface, naming the
chunks' scope (the file tier keeps a directory per scope), and it adds:

- **LOOKUP** (`prefix_hits`): the prefix L1 holds, then how far the file tier continues it (its
  index, a ``stat`` for what that lacks), then the remote tier (one pipelined round trip). The
  chunks found on disk start being read into L1 at once (`_read_ahead`, on the file tier's I/O
  threads), so the RETRIEVE that follows finds them there.
  The chunks found in the remote tier likewise, on its reader thread (`_remote_ahead`): a hit
  there is on its way into L1 while the engine is still deciding to load it.
- **RETRIEVE** (`acquire_prefix`): what L1 lacks is read from the file tier (or waited for, while
  a read-ahead brings it), then from the remote tier (or waited for likewise), checked, and
  promoted into L1 (pinned like the rest), chunk by chunk until the first miss.
- **STORE** (`commit`): a chunk newly committed to L1 is queued for the file and remote tiers
  (write-behind, never waited for), its L1 buffer pinned until each write is done. With the hot
  cache off (``local_cpu=false``) L1 only stages: a chunk leaves L1 once written and no reader
  holds it.
- **CLEAR** (`clear_scope`): every chunk of a scope leaves every tier, and none read or written
  before the clear enters one after it (a reset after the model's weights changed).
- **The health gate** (``gate``, the health monitor's ``is_healthy``): while it says no,
  STORE is skipped (`writable`), RETRIEVE is an all-miss and LOOKUP is 0, each with a warning
  at most every `WARN_EVERY_S` (the count of what was skipped meanwhile in it).

File tier reads run on its I/O threads, the caller waiting at most the tier's deadline; remote
reads run on the caller's thread (transfer and normal workers), each bounded by the
backend's timeout, and never on the loop thread: what it may call (`acquire_local`, `commit`,
which only queues the write, `release`, `pin_present`, `reserve`) never calls Redis nor the disk. A one-copy
ACQUIRE answered on the loop takes L1's part of the prefix with `acquire_local`, and is handed to
the transfer pool when the remote tier might continue it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from dataplane.storage.fs import FileTier
from dataplane.storage.keys import ScopeMatch
from dataplane.storage.l1 import L1Store, ScopeCleared
from dataplane.storage.l1.arena import Arena
from dataplane.storage.l1.store import CLEAR_WAIT_S
from dataplane.storage.l1.tenants import NO_TENANT
from dataplane.storage.remote import RemoteBackend

logger = logging.getLogger(__name__)

WARN_EVERY_S = 10.0
_DTYPE = "uint8"  # chunks are bytes; the key binds the layout (dataplane.storage.keys)


class TieredStore(L1Store):
    def __init__(
        self,
        capacity_bytes: int,
        hot_cache: bool = True,
        arena: Arena | None = None,
        clock: Callable[[], float] = time.monotonic,
        remote: RemoteBackend | None = None,
        gate: Callable[[], bool] | None = None,
        tenant_share_bytes: int | None = None,
        fs: FileTier | None = None,
        policy: str = "lru",
    ) -> None:
        super().__init__(capacity_bytes, hot_cache, arena, clock, tenant_share_bytes, policy)
        self.remote = remote
        self.fs = fs
        self._ahead_lock = threading.Lock()  # leaf: guards _ahead
        self._ahead: dict[bytes, threading.Event] = {}  # keys a read-ahead is bringing into L1
        self.gate = gate or (lambda: True)
        self._warn_lock = threading.Lock()  # leaf: guards _warned_at and _suppressed
        self._warned_at: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self.promoted = 0  # chunks read from the remote tier into L1
        self.remote_read_ahead = 0  # of those, read ahead of a RETRIEVE because a LOOKUP found them

    # ------------------------------------------------------------------ gate
    def writable(self) -> bool:
        return self._open("STORE", "skipped")

    def _open(self, what: str, answer: str) -> bool:
        if self.gate():
            return True
        self._warn(what, answer)
        return False

    def _warn(self, what: str, answer: str) -> None:
        now = self._clock()
        with self._warn_lock:
            last = self._warned_at.get(what)
            if last is not None and now - last < WARN_EVERY_S:
                self._suppressed[what] = self._suppressed.get(what, 0) + 1
                return
            self._warned_at[what] = now
            n = self._suppressed.pop(what, 0)
        more = f" ({n} more since the last warning)" if n else ""
        logger.warning("storage: unhealthy (recompute): %s %s%s", what, answer, more)

    # ----------------------------------------------------------------- reads
    def prefix_hits(self, keys: list[bytes], scope: bytes = b"", tenant: bytes = NO_TENANT) -> int:
        return sum(self.prefix_split(keys, scope, tenant))

    def prefix_split(
        self, keys: list[bytes], scope: bytes = b"", tenant: bytes = NO_TENANT
    ) -> tuple[int, int, int]:
        """`prefix_hits` by tier: (L1's prefix, the chunks the file tier continues it by, then
        the remote tier), the lower tiers' starting on their way into L1."""
        if not self._open("LOOKUP", "answered 0"):
            return 0, 0, 0
        n = in_l1 = super().prefix_hits(keys)
        on_disk = more = 0
        if self.fs is not None and n < len(keys):
            on_disk = self.fs.held(scope, keys[n:])
            if on_disk:
                self._read_ahead(scope, keys[n : n + on_disk], tenant, self._chunk_bytes(keys[:n]))
            n += on_disk
        if self.remote is not None and n < len(keys):
            more = self.remote.count_prefix(keys[n:], scope=scope)
            if more:
                self._remote_ahead(scope, keys[n : n + more], tenant, self._chunk_bytes(keys[:n]))
        return in_l1, on_disk, more

    def acquire_prefix(
        self, keys: list[bytes], tenant: bytes = NO_TENANT, scope: bytes = b""
    ) -> list[torch.Tensor]:
        if not self._open("RETRIEVE", "answered with misses"):
            return []
        bufs = super().acquire_prefix(keys)
        if (self.remote is None and self.fs is None) or len(bufs) == len(keys):
            return bufs
        nbytes = bufs[0].numel() if bufs else None
        return bufs + self._lower_prefix(keys[len(bufs) :], tenant, scope, nbytes)

    def acquire_into(
        self,
        keys: list[bytes],
        into: Callable[[int, int], Sequence[memoryview] | None],
        tenant: bytes = NO_TENANT,
        scope: bytes = b"",
        later: Callable[[Callable[[], None]], None] | None = None,
        nbytes: int | None = None,
    ) -> list[torch.Tensor | None]:
        """`acquire_prefix` for a caller that takes chunks in place at ``into(i, size)`` (the
        worker's blocks, or None): a chunk L1 lacks whose file is warm is read there (`get_into`;
        side by side when ``nbytes``, a chunk's bytes, is known: `get_many_into`), None in its
        place; L1 gets it after the reply (``later``, else at once: ``promoted``)."""
        if self.fs is None:
            return list(self.acquire_prefix(keys, tenant, scope))
        if not self._open("RETRIEVE", "answered with misses"):
            return []
        got: list[torch.Tensor | None] = list(super().acquire_prefix(keys))
        size: list[int] = [got[0].numel()] if got and got[0] is not None else [nbytes] if nbytes else []
        placed: list[bytes] = []
        first = i = len(got)
        run = list(itertools.takewhile(lambda k: k not in self._ahead, keys[i:]))
        pre = self.fs.get_many_into(scope, run, size[0], lambda j: into(first + j, size[0])) if size else []
        while i < len(keys) and keys[i] not in self._ahead:  # (a read brings it: wait for that)

            def where(n: int, i: int = i) -> Sequence[memoryview] | None:
                size[:] = [n]
                return into(i, n)

            known = size[0] if size else None
            r: bool | torch.Tensor | None = (
                pre[i - first] if i - first < len(pre) else self.fs.get_into(scope, keys[i], known, where)
            )
            staged = r is False and i == len(keys) - 1
            if staged:  # the last chunk, not all in memory: through L1, on to the worker as it lands
                r = self._through(scope, keys[i], known, tenant, where)
            if r is None and self.remote is not None:  # not on disk after all (or damaged)
                r = self._promote(scope, keys[i], known, tenant)
            if r is False:  # not in memory whole (or no views): read the staged way, below
                break
            if r is None:  # the prefix ends here
                i = len(keys)
                break
            got.append(r if isinstance(r, torch.Tensor) else None)  # (None: in place already)
            if isinstance(r, torch.Tensor):
                size[:] = [r.numel()]
            elif not staged:  # read in place: L1 gets it behind the reply
                placed.append(keys[i])
            i += 1
        nbytes = size[0] if size else None
        if placed:

            def promote() -> None:
                self._read_ahead(scope, placed, tenant, nbytes, "promoted")

            (later or (lambda fn: fn()))(promote)
        if i < len(keys):
            got += self._lower_prefix(keys[i:], tenant, scope, nbytes)
        return got

    def _through(
        self,
        scope: bytes,
        key: bytes,
        nbytes: int | None,
        tenant: bytes,
        where: Callable[[int], Sequence[memoryview] | None],
    ) -> bool | torch.Tensor | None:
        """``key``'s file read into L1 and, as it lands, into ``where(size)`` (`FileTier.
        get_through`): True (in L1 and in place), its pinned L1 buffer (in L1 only: no views),
        None (a miss)."""
        assert self.fs is not None
        held, alloc, give_back = self._staging(tenant)
        since = self.epoch()
        got = self.fs.get_through(scope, key, nbytes, alloc, give_back, where)
        if got is None:
            return None
        super().commit(key, held.pop(), scope=scope, since=since)  # (a copy that won a race stays)
        if got[1]:
            return True
        pinned = self._pin_prefix([key], hits=False)  # (the file tier counts it)
        return pinned[0] if pinned else None

    def _lower_prefix(
        self, rest: list[bytes], tenant: bytes, scope: bytes, nbytes: int | None
    ) -> list[torch.Tensor]:
        """What the lower tiers hold of ``rest`` (a prefix L1 lacks), in L1 and pinned."""
        started: dict[bytes, threading.Event] = {}
        if self.fs is not None and len(rest) > 1:  # read them side by side, used in order below
            on_disk = self.fs.held(scope, rest)
            if on_disk > 1:
                started = self._read_ahead(scope, rest[:on_disk], tenant, nbytes, counter=None)
        bufs: list[torch.Tensor] = []
        for key in rest:
            buf = self._lower(scope, key, nbytes, tenant, started.get(key))
            if buf is None:
                break
            nbytes = buf.numel()
            bufs.append(buf)
        return bufs

    def acquire_local(self, keys: list[bytes], scope: bytes = b"") -> list[torch.Tensor] | None:
        """`acquire_prefix` for a caller that must not wait (the loop thread): what L1 holds of
        the prefix, pinned, when no lower tier could add to it; None (nothing pinned) when one
        might: the caller asks `acquire_prefix` where waiting is fine. Never calls Redis nor the
        disk."""
        if not self._open("RETRIEVE", "answered with misses"):
            return []
        bufs = self._pin_prefix(keys, hits=False)  # (counted once answered, below)
        if (self.remote is None and self.fs is None) or len(bufs) == len(keys):
            self._count_hits(keys[: len(bufs)])
            return bufs
        super().release(keys[: len(bufs)])  # (L1's own release: they stay as they were)
        return None

    def _lower(
        self,
        scope: bytes,
        key: bytes,
        nbytes: int | None,
        tenant: bytes,
        ahead: threading.Event | None = None,
    ) -> torch.Tensor | None:
        """The chunk of ``key`` from the file tier, else the remote tier, in L1 and pinned.
        ``ahead``: the read of it this RETRIEVE started (else one a LOOKUP started, if any)."""
        ahead = ahead or self._ahead.get(key)
        if ahead is not None:  # a read is bringing it: wait for that, never read it twice
            ahead.wait(self.fs.io.timeout_s if self.fs is not None else self._remote_wait_s())
        got = self._pin_prefix([key], hits=False)  # (a read-ahead may have brought it already)
        if got:
            return got[0]
        if self.fs is not None and ahead is None and self._from_fs(scope, key, nbytes, tenant, wait=True):
            got = self._pin_prefix([key], hits=False)
            if got:
                return got[0]
        if self.remote is not None:
            return self._promote(scope, key, nbytes, tenant)
        return None

    def _remote_wait_s(self) -> float:
        assert self.remote is not None
        return self.remote.timeout_s

    def _remote_ahead(self, scope: bytes, keys: list[bytes], tenant: bytes, nbytes: int | None) -> None:
        """Start reading ``keys`` (found in the remote tier by a LOOKUP) into L1 on the remote
        tier's reader thread, so the RETRIEVE that follows finds them there, or waits for them
        (`_lower`) instead of asking Redis again. A key another read is bringing is skipped."""
        remote = self.remote
        assert remote is not None
        with self._ahead_lock:
            mine = {k: threading.Event() for k in keys if k not in self._ahead}
            self._ahead.update(mine)
        shape = None if nbytes is None else (nbytes,)
        since = self.epoch()
        for k, ev in mine.items():
            held, alloc, give_back = self._staging(tenant)
            landed = functools.partial(self._landed, scope, since, k, ev, held)
            if not remote.get_later(k, _DTYPE, shape, landed, alloc, give_back, scope=scope):
                self._ahead_done(k, ev)

    def _landed(
        self,
        scope: bytes,
        since: int,
        key: bytes,
        ev: threading.Event,
        held: list[torch.Tensor],
        payload: memoryview | None,
    ) -> None:
        """A read-ahead from the remote tier is over: its chunk (if any), read into the L1
        buffer ``held`` has, is committed (a copy already there stays; ours goes back; one of
        a scope cleared since the read began is dropped)."""
        try:
            if payload is not None and held and super().commit(key, held.pop(), scope=scope, since=since):
                self.promoted += 1
                self.remote_read_ahead += 1
        finally:
            while held:  # (a read that failed after its buffer was given)
                self.abort(held.pop())
            self._ahead_done(key, ev)

    def _ahead_done(self, key: bytes, ev: threading.Event) -> None:
        with self._ahead_lock:
            if self._ahead.get(key) is ev:
                del self._ahead[key]
        ev.set()

    def _from_fs(
        self, scope: bytes, key: bytes, nbytes: int | None, tenant: bytes, wait: bool, hit: bool = True
    ) -> bool:
        """Read ``key``'s file into L1 (committed, not pinned): waiting at most the tier's
        deadline, or on this thread (``wait=False``: an I/O thread's read-ahead; ``hit=False``:
        the promotion of a chunk read in place, its hit counted then). Whether L1 holds the
        chunk now."""
        assert self.fs is not None
        held, alloc, give_back = self._staging(tenant)
        since = self.epoch()
        got = self.fs.get(scope, key, nbytes, alloc, give_back, wait=wait, hit=hit)
        if got is None:
            return False
        # (a copy that won a race stays; ours goes back; so does one read before a clear)
        return super().commit(key, held.pop(), scope=scope, since=since) or bool(super().peek_prefix([key]))

    def _staging(
        self, tenant: bytes
    ) -> tuple[list[torch.Tensor], Callable[[int], memoryview | None], Callable[[memoryview], None]]:
        """L1 buffers for a lower tier's read to land in: those reserved (``held``), how to
        reserve one for ``tenant`` (None: no room), how to give one back."""
        held: list[torch.Tensor] = []

        def alloc(n: int) -> memoryview | None:
            buf = self.reserve(n, tenant)
            if buf is None:
                return None
            held.append(buf)
            return buf.numpy().data.cast("B")

        def give_back(_: memoryview) -> None:
            self.abort(held.pop())

        return held, alloc, give_back

    def _read_ahead(
        self,
        scope: bytes,
        keys: list[bytes],
        tenant: bytes,
        nbytes: int | None,
        counter: str | None = "read_ahead",
    ) -> dict[bytes, threading.Event]:
        """Start reading ``keys`` (found on disk by a LOOKUP, or wanted by a RETRIEVE) into L1,
        each on an I/O thread of its own as they come free; a RETRIEVE that wants one meanwhile
        waits for it (`_lower`). Each chunk brought counts to the file tier's ``counter`` (a
        LOOKUP's: read_ahead; after a read in place: promoted). Returns the reads it started (a
        key another read is bringing already is not read again)."""
        assert self.fs is not None
        fs = self.fs
        with self._ahead_lock:
            mine = {k: threading.Event() for k in keys if k not in self._ahead}
            self._ahead.update(mine)

        done = self._ahead_done

        def run(k: bytes, ev: threading.Event) -> None:
            try:
                here = super(TieredStore, self).prefix_hits([k])
                hit = counter != "promoted"
                if not here and self._from_fs(scope, k, nbytes, tenant, False, hit) and counter:
                    fs.counters.add(**{counter: 1})
            finally:
                done(k, ev)

        for k, ev in mine.items():
            if not fs.io.submit(functools.partial(run, k, ev)):
                done(k, ev)
        return mine

    def _chunk_bytes(self, keys: list[bytes]) -> int | None:
        """The size of the chunks of ``keys`` (those L1 holds), None when it holds none."""
        got = self._pin_prefix(keys[-1:], hits=False) if keys else []
        if not got:
            return None
        n = got[0].numel()
        super().release(keys[-1:])
        return n

    def _promote(self, scope: bytes, key: bytes, nbytes: int | None, tenant: bytes) -> torch.Tensor | None:
        """The chunk of ``key`` from the remote tier, read into L1 and pinned; None: not there
        (or damaged, or of another size, or L1 has no room)."""
        assert self.remote is not None
        held, alloc, give_back = self._staging(tenant)
        since = self.epoch()
        try:
            shape = None if nbytes is None else (nbytes,)
            payload = self.remote.get(key, _DTYPE, shape, alloc, give_back, scope=scope)
            if payload is None or not held:
                return None
            # not commit(): it came from the remote tier
            super().commit(key, held.pop(), scope=scope, since=since)
        finally:
            while held:
                self.abort(held.pop())
        got = self._pin_prefix([key], hits=False)  # pinned (whichever copy won a race)
        if got:
            self.promoted += 1
        return got[0] if got else None

    # ---------------------------------------------------------------- writes
    def commit(
        self,
        key: bytes,
        buf: torch.Tensor,
        pin: bool = False,
        scope: bytes = b"",
        since: int | None = None,
        words: str | None = None,
    ) -> bool:
        written = super().commit(key, buf, pin, scope, since, words)
        if not written:
            return written
        view = memoryview(buf.numpy().data)
        for tier in (self.fs, self.remote):
            if tier is None:
                continue
            self.pin_present([key])  # until the write-behind queue is done with its bytes
            done = lambda: self._written(key)  # noqa: E731
            if tier is self.fs:
                self.fs.put(scope, key, view, done, words=words)
            else:
                assert self.remote is not None
                self.remote.put(key, _DTYPE, (buf.numel(),), view, done, scope=scope, words=words)
        return written

    # ---------------------------------------------------------------- clears
    def clear_scope(self, scope: ScopeMatch, wait_s: float = CLEAR_WAIT_S) -> ScopeCleared:
        """Remove every chunk ``scope`` matches from every tier: L1 stops taking those chunks
        (`begin_clear`), the file and remote tiers drop its queued writes, wait for the one
        under way and remove what they hold, then L1 drops its own (waiting at most ``wait_s``
        for readers), and no chunk read from a lower tier before it was cleared enters L1
        after. Runs on the caller's thread (a NORMAL worker: never the loop), which waits for
        the disk and Redis; a tier that cannot be cleared (down, an error) is named in
        ``failed``: its chunks may still be there, and the clear is not complete."""
        self.begin_clear(scope)
        failed: list[str] = []
        fs = remote = None
        try:
            if self.fs is not None:
                fs = self.fs.clear_scope(scope)
                if fs is None:
                    failed.append(self.fs.name)
            if self.remote is not None:
                remote = self.remote.clear_scope(scope)
                if remote is None:
                    failed.append(self.remote.name)
        finally:
            dropped, left = self.end_clear(scope, wait_s)
        return ScopeCleared(dropped, fs, remote, left, tuple(failed))

    def _written(self, key: bytes) -> None:
        """A lower tier's write of ``key`` is done (written, failed or dropped)."""
        self.release([key])
        if not self.hot_cache:
            self.discard([key])

    def release(self, keys: list[bytes]) -> None:
        super().release(keys)
        if not self.hot_cache and (self.remote is not None or self.fs is not None):
            self.discard(keys)  # staging only: what no reader holds leaves L1
