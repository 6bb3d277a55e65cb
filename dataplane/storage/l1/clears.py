"""The clears L1 has seen (`L1Store.begin_clear` .. `end_clear`): which filing scopes are being
cleared now, and the epoch (clears begun so far) at which the last clear of each began, so that
a chunk whose bytes were produced before its scope's clear never enters L1 after it."""

from __future__ import annotations

from dataplane.storage.keys import ScopeMatch


class ClearBook:
    """Guarded by the owning `L1Store`'s lock: it has none of its own."""

    def __init__(self) -> None:
        self.epoch = 0  # clears begun so far
        self._began: dict[ScopeMatch, int] = {}  # scopes cleared -> the epoch their last clear began at
        self._running: dict[ScopeMatch, int] = {}  # scopes being cleared -> clears of them running

    @property
    def running(self) -> bool:
        return bool(self._running)

    def begin(self, scope: ScopeMatch) -> None:
        self.epoch += 1
        self._began[scope] = self.epoch
        self._running[scope] = self._running.get(scope, 0) + 1

    def end(self, scope: ScopeMatch) -> None:
        n = self._running.get(scope, 0) - 1
        if n > 0:
            self._running[scope] = n
        else:
            self._running.pop(scope, None)

    def stale(self, scope: bytes, since: int) -> bool:
        """Whether a chunk filed under ``scope`` whose bytes were produced at epoch ``since``
        is stale: a clear of it runs now, or one began after that."""
        if not self._running and since >= self.epoch:
            return False  # (a commit's bytes began after the last clear began: no scan)
        return any(m.matches(scope) for m in self._running) or any(
            at > since and m.matches(scope) for m, at in self._began.items()
        )
