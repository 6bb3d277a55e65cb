"""Per-instance entries with liveness: one registry per transfer module, owned, not inherited.

Each entry carries ``last_seen`` (monotonic, injected clock), ``has_liveness_signal`` (latched
by PING only), the connection it last spoke over and, once that connection closed, when.
``_lock`` is a leaf lock guarding the entry dict and every entry's mutable fields; it is never
held while mapping memory, copying, calling storage or another component. Scans (a reap, a
closed connection) take it in slices, so 100,000 tracked instances never hold it for long.
Releasing an entry's resources is the owner's ``release`` callback; it runs outside the lock on
a short-lived thread, bounded by ``release_timeout_s``: a stuck release is logged and abandoned,
never wedging the reaper. An entry held by a request (``use``) is released by its last user.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

from dataplane.liveness.entry import (
    ContextEntry,
    Entry,
    LivenessRow,
    Row,
    from_row,
    mark_removed,
    own,
    owned_by,
    public,
    row,
    seen_over,
)
from dataplane.liveness.quota import InstanceQuota
from dataplane.liveness.target import InstanceLivenessTarget, Reaped
from dataplane.wire.errors import NotRegistered

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
MAX_SCOPES = 4096  # (model, world size, rank, scope) remembered for a router's lookup
_SLICE = 1024
_ROW_SLICE = 2048  # liveness rows copied per hold of the lock: ~0.3 ms (and a ~55 us sleep after)


E = TypeVar("E", bound=Entry)


class LivenessRegistry(InstanceLivenessTarget, Generic[E]):
    def __init__(
        self,
        name: str,
        release: Callable[[E, str], None],
        clock: Clock = time.monotonic,
        release_timeout_s: float = 10.0,
        quota: InstanceQuota | None = None,
    ) -> None:
        self.name = name
        self._release = release  # frees an entry's resources; runs outside the lock
        self._clock = clock
        self.release_timeout_s = release_timeout_s
        self._quota = quota  # shared by the registries of one server
        self._lock = threading.Lock()  # guards _entries, every entry's mutable fields and _scopes
        self._entries: dict[int, E] = {}
        # model -> (world size, rank, chunk-key scope) of every instance ever registered for it (the
        # chunks outlive their workers: a router's lookup asks for them); at most MAX_SCOPES
        self._scopes: OrderedDict[tuple[str, int, int, bytes], None] = OrderedDict()

    # ------------------------------------------------------------------ insert
    def refresh_if(
        self, instance_id: int, same: Callable[[E], bool], conn_fd: int = -1, secret: bytes | None = None
    ) -> E | None:
        """A repeat registration: when the entry exists and ``same(entry)``, refresh its
        ``last_seen`` (never latching the signal) and return it; else None. NotOwner when the
        entry was registered with another secret."""
        with self._lock:
            e = self._entries.get(instance_id)
            if e is None:
                return None
            own(e, secret)
            if not same(e):
                return None
            e.last_seen = self._clock()
            seen_over(e, conn_fd)
            return e

    def put(self, entry: E, why_replaced: str) -> None:
        """Insert ``entry``; an entry it replaces (only its owner may replace it: NotOwner
        otherwise) is released, by its last user if in use. A new id takes a place of the
        quota first (LimitExceeded when there is none left)."""
        with self._lock:
            known = entry.instance_id in self._entries
        admitted = not known and self._quota is not None
        if admitted:
            assert self._quota is not None
            self._quota.admit(
                entry.instance_id, entry.conn_fd, entry.secret
            )  # its own lock, never under ours
        try:
            with self._lock:
                old = self._entries.get(entry.instance_id)
                if old is not None:
                    own(old, entry.secret)
                self._entries[entry.instance_id] = entry
                idle = old is not None and mark_removed(old)
                i = entry.info
                self._scopes[(i.model_name, i.world_size, i.worker_id, entry.scope)] = None
                self._scopes.move_to_end((i.model_name, i.world_size, i.worker_id, entry.scope))
                if len(self._scopes) > MAX_SCOPES:
                    self._scopes.popitem(last=False)
        except BaseException:
            if admitted:
                self._forget([entry.instance_id])
            raise
        if admitted and old is not None:  # another register of the same id got in first
            self._forget([entry.instance_id])
        if idle and old is not None:
            self._bounded_release([old], why_replaced)

    # ---------------------------------------------------------------- liveness
    def touch_instance(self, instance_id: int, conn_fd: int = -1, secret: bytes | None = None) -> bool:
        """Refresh and latch; False (touching nothing) for an unknown id or a wrong secret."""
        with self._lock:
            e = self._entries.get(instance_id)
            if e is None or not owned_by(e, secret):
                return False
            e.last_seen = self._clock()
            e.has_liveness_signal = True
            seen_over(e, conn_fd)
            return True

    def tracked_instance_count(self) -> int:
        with self._lock:
            return len(self._entries)

    def mark_connection_closed(self, conn_fd: int, now: float) -> int:
        def closed(e: E) -> bool:
            # last_seen > now: it spoke after the close, over a new connection that reuses the
            # fd number; it is alive
            if e.conn_fd == conn_fd and e.disconnected_at is None and e.last_seen <= now:
                e.disconnected_at = now
                return True
            return False

        return sum(1 for _ in self._scan(closed))

    def reap_stale_instances(self, timeout_s: float, grace_s: float) -> list[Reaped]:
        now = self._clock()

        def stale(e: E) -> str | None:
            if e.has_liveness_signal:
                return "timeout" if now - e.last_seen > timeout_s else None
            return "grace" if now - e.last_seen > grace_s else None

        return self._reap(stale, now)

    def reap_disconnected_instances(self, disconnect_grace_s: float) -> list[Reaped]:
        now = self._clock()

        def gone(e: E) -> str | None:
            t = e.disconnected_at
            return "disconnect" if t is not None and now - t > disconnect_grace_s else None

        return self._reap(gone, now)

    def remove_instances(self, instance_ids: Iterable[int], why: str) -> list[int]:
        """The cleanup UNREGISTER, the reaper and the admin route share: pop each id, release
        the idle ones (the last user releases the others). The ids that were held."""
        held: list[int] = []
        idle: list[E] = []
        with self._lock:
            for iid in instance_ids:
                e = self._entries.pop(iid, None)
                if e is not None:
                    held.append(iid)
                    if mark_removed(e):
                        idle.append(e)
        self._forget(held)
        self._bounded_release(idle, why)
        return held

    def check_owner(self, instance_id: int, secret: bytes) -> None:
        """NotOwner when ``instance_id`` is held here under another secret."""
        with self._lock:
            e = self._entries.get(instance_id)
            if e is not None:
                own(e, secret)

    def close(self) -> None:
        with self._lock:
            victims = list(self._entries)
        self.remove_instances(victims, "shutdown")

    # --------------------------------------------------------------- accessors
    def context_entries_snapshot(self) -> list[ContextEntry]:
        # plain tuples are copied under the lock, a slice at a time (PING waits on it), and
        # the entries built after: each entry is consistent, the list need not be one instant
        rows: list[Row] = []
        with self._lock:
            ids = list(self._entries)
        for start in range(0, len(ids), _SLICE):
            with self._lock:
                for iid in ids[start : start + _SLICE]:
                    e = self._entries.get(iid)
                    if e is not None:
                        rows.append(row(e))
            time.sleep(0)  # as in _scan: a PING waiting on the lock goes first
        out: list[ContextEntry] = []
        for start in range(0, len(rows), _SLICE // 8):
            out += [from_row(*r) for r in rows[start : start + _SLICE // 8]]
            time.sleep(0)  # hand the GIL over: PING is answered on the loop thread of this process
        return out

    def liveness_rows(self) -> list[LivenessRow]:
        """What changes of every tracked instance, as plain tuples (the /status build: what is
        fixed at registration it reads once per instance, through `context_entry`). Copied under
        the lock a slice at a time, the GIL handed over between slices (PING waits on both)."""
        out: list[LivenessRow] = []
        with self._lock:
            ids = list(self._entries)
        for start in range(0, len(ids), _ROW_SLICE):
            with self._lock:
                get, add = self._entries.get, out.append
                for iid in ids[start : start + _ROW_SLICE]:
                    e = get(iid)
                    if e is not None:  # a LivenessRow (built inline: this loop is ~25% of a build)
                        gone = e.disconnected_at is not None
                        add((iid, e.registered_at, e.last_seen, e.has_liveness_signal, gone))
            time.sleep(0)
        return out

    def scopes_of(self, model_name: str) -> set[tuple[int, int, bytes]]:
        """(world size, rank, chunk-key scope) of the instances registered for ``model_name``
        since start (those gone too: their chunks may still be held)."""
        with self._lock:
            return {(w, r, s) for m, w, r, s in self._scopes if m == model_name}

    def context_entry(self, instance_id: int) -> ContextEntry | None:
        with self._lock:
            e = self._entries.get(instance_id)
            return None if e is None else public(e)

    def scope_of(self, instance_id: int, conn_fd: int = -1, secret: bytes | None = None) -> bytes | None:
        """The chunk-key scope of a tracked instance (refreshing last_seen), else None."""
        with self._lock:
            e = self._entries.get(instance_id)
            if e is None:
                return None
            self._claim(e, conn_fd, secret)
            return e.scope

    def touch(self, instance_id: int, conn_fd: int = -1, secret: bytes | None = None) -> E:
        """The entry of a tracked instance its owner asks for (refreshing last_seen), without
        holding it: for a request that only updates the instance's own state under that state's
        locks (never its worker's memory), so a release need not wait for it. NotRegistered /
        NotOwner as `use`."""
        with self._lock:
            return self._claim(self._get(instance_id), conn_fd, secret)

    @contextmanager
    def use(self, instance_id: int, conn_fd: int = -1, secret: bytes | None = None) -> Iterator[E]:
        """Hold an entry for a request: refreshes last_seen; release waits for the last user."""
        with self._lock:
            e = self._claim(self._get(instance_id), conn_fd, secret)
            e.users += 1
        try:
            yield e
        finally:
            with self._lock:
                e.users -= 1
                last = e.removed and e.users == 0
            if last:
                self._bounded_release([e], "deferred")

    # --------------------------------------------------------------- internals
    def _claim(self, e: E, conn_fd: int, secret: bytes | None) -> E:
        """A request of ``e``'s owner (NotOwner otherwise): it was seen now, over ``conn_fd``.
        Lock held."""
        own(e, secret)
        e.last_seen = self._clock()
        seen_over(e, conn_fd)
        return e

    def _get(self, instance_id: int) -> E:
        e = self._entries.get(instance_id)
        if e is None:
            raise NotRegistered(f"instance {instance_id} is not registered")
        return e

    def _scan(self, visit: Callable[[E], object]) -> Iterator[E]:
        """Entries for which ``visit`` (run under the lock) returns truthy, in slices."""
        with self._lock:
            ids = list(self._entries)
        for start in range(0, len(ids), _SLICE):
            hits: list[E] = []
            with self._lock:
                for iid in ids[start : start + _SLICE]:
                    e = self._entries.get(iid)
                    if e is not None and visit(e):
                        hits.append(e)
            # Lock and GIL are not fair: without a pause this thread would take the lock
            # straight back and a PING waiting on it would wait out the whole scan.
            time.sleep(0)
            yield from hits

    def _reap(self, why: Callable[[E], str | None], now: float) -> list[Reaped]:
        reaped: list[Reaped] = []
        idle: list[E] = []

        def collect_and_pop(e: E) -> bool:  # runs under the lock
            reason = why(e)
            if reason is None:
                return False
            del self._entries[e.instance_id]
            reaped.append(Reaped(e.instance_id, reason, now - e.last_seen, e.has_liveness_signal))
            if mark_removed(e):
                idle.append(e)
            return True

        for _ in self._scan(collect_and_pop):
            pass
        self._forget([r.instance_id for r in reaped])
        self._bounded_release(idle, "reap")  # first: nothing below can leak a popped entry
        for r in reaped:
            logger.warning(
                "reaper: reaped instance %d (%s; silent %.1fs; %s)",
                r.instance_id,
                r.reason,
                r.silence_s,
                "pinged" if r.pinged else "never pinged",
            )
        return reaped

    def _forget(self, ids: list[int]) -> None:
        if self._quota is not None and ids:
            self._quota.forget(ids)

    def _bounded_release(self, entries: list[E], why: str) -> None:
        if not entries:
            return
        t = threading.Thread(
            target=self._release_all, args=(entries, why), daemon=True, name="kvwarden-release"
        )
        t.start()
        t.join(self.release_timeout_s)
        if t.is_alive():
            logger.error(
                "registry: releasing %d instance(s) (%s) is stuck after %.1fs; moving on",
                len(entries),
                why,
                self.release_timeout_s,
            )

    def _release_all(self, entries: list[E], why: str) -> None:
        for e in entries:
            try:
                self._release(e, why)
            except Exception:
                logger.exception("registry: releasing instance %d (%s) failed", e.instance_id, why)
