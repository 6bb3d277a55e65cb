"""Read-your-writes for the vLLM connector's scheduler: a request whose prefix is being stored
waits for it (vLLM is told "not decided yet" and asks again on a later step) instead of
recomputing what is about to land.

Two sources say a prefix is on its way. The server's lookups count chunks that any worker of
the scope is writing now (``pending_tokens``). This engine's own saves count from the moment
the scheduler plans them, before its worker has even sent the store (``OwnSaves``): the worker
reports each save over, stored or failed, in the step's worker metadata. ``Waits`` decides,
request by request: answer the hit now, or wait; a wait ends when what was awaited is held
(``hit``), when nothing more is on its way (``partial``: the store failed, was cut short or its
worker died; the server drops a dead connection's stores at once), or when the bound passes
(``gave_up``). Each ended wait is reported to the server for its /metrics (LOOKUP_WAITED).
Scheduler thread only: no locks.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from dataplane.wire.messages import KeyContext

REASK_S = 0.002  # a waiting request asks the server again at most this often
OWN_SAVE_MAX_S = 120.0  # a save its worker never reported over stops counting after this


@dataclass(frozen=True)
class LookupFound:
    """What a lookup found: ``hit`` tokens held, ``pending`` more being stored after them;
    ``answered`` False when the server could not be asked (then nothing is waited for); ``l1``
    of ``hit``, the tokens the server held in L1 (a load of those alone is a memory copy);
    ``fs`` those after them its file tier held (the rest of ``hit``: the remote tier)."""

    hit: int
    pending: int = 0
    answered: bool = True
    l1: int = 0
    fs: int = 0


@dataclass
class _Own:
    tokens: np.ndarray
    key: KeyContext | None
    reports: int  # worker reports still to come (one per rank)
    planned_at: float
    req_id: str
    blocks: np.ndarray | None  # the saved request's blocks, while they may be copied from


@dataclass(frozen=True)
class Source:
    """A save still on its way whose blocks hold the KV of ``tokens`` tokens of a prompt: a
    request of this engine with that prefix copies them (its worker, block to block) instead of
    waiting for the save to land and loading it back."""

    tokens: int
    seq: int
    blocks: np.ndarray


class OwnSaves:
    """The saves this engine's scheduler planned that its workers have not reported over.

    A save's blocks stay the saved request's until its workers report the save over (vLLM
    frees a finished request's blocks only then: ``Planner.finished``), and a report comes
    after the step in which it was made: while the save counts here, a load planned in this
    step may copy from its blocks, unless the request was preempted (``no_source``)."""

    def __init__(self, ranks: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        self.ranks = ranks
        self._clock = clock
        self._saves: dict[int, _Own] = {}
        self._seq = itertools.count(1)

    def add(
        self, tokens: np.ndarray, key: KeyContext | None, req_id: str = "", blocks: np.ndarray | None = None
    ) -> int:
        """Request ``req_id``'s save of ``tokens`` (a prompt's first full chunks, from
        ``blocks``) was planned: its sequence number, which the worker reports when it is over."""
        seq = next(self._seq)
        self._saves[seq] = _Own(tokens, key, self.ranks, self._clock(), req_id, blocks)
        return seq

    def no_source(self, req_ids: Iterable[str]) -> None:
        """These requests' blocks go back to vLLM (they were preempted): never copied from."""
        gone = set(req_ids)
        for own in self._saves.values():
            if own.req_id in gone:
                own.blocks = None

    def source(self, tokens: np.ndarray, key: KeyContext | None) -> Source | None:
        """The save still on its way, blocks at hand, that covers the longest prefix of
        ``tokens`` (None: none covers any)."""
        best: Source | None = None
        for seq, own in self._live():
            if own.blocks is None or own.key != key:
                continue
            n = _common(own.tokens, tokens)
            if n and (best is None or n > best.tokens):
                best = Source(n, seq, own.blocks)
        return best

    def holds(self, seq: int) -> bool:
        """The save is still on its way and its blocks may be copied from."""
        own = self._saves.get(seq)
        return own is not None and own.blocks is not None and own.planned_at >= self._clock() - OWN_SAVE_MAX_S

    def done(self, seqs: Iterable[int]) -> None:
        """Worker reports: each sequence number once per rank whose save is over."""
        for seq in seqs:
            own = self._saves.get(seq)
            if own is not None:
                own.reports -= 1
                if own.reports <= 0:
                    del self._saves[seq]

    def reach(self, tokens: np.ndarray, key: KeyContext | None) -> int:
        """The longest prefix of ``tokens`` that a save still on its way covers (0: none)."""
        best = 0
        for _, own in self._live():
            if own.key == key and min(len(own.tokens), len(tokens)) > best:
                best = max(best, _common(own.tokens, tokens))
        return best

    def forget(self) -> None:
        """The engine's cache was reset (its weights changed): no save still on its way is a
        source to copy from or to wait for any more."""
        self._saves.clear()

    def _live(self) -> list[tuple[int, _Own]]:
        stale = self._clock() - OWN_SAVE_MAX_S
        for seq in [s for s, own in self._saves.items() if own.planned_at < stale]:
            del self._saves[seq]  # never reported: its worker is gone
        return list(self._saves.items())

    def __len__(self) -> int:
        return len(self._saves)


@dataclass
class _Wait:
    start: float
    want: int  # tokens waited for
    next_ask: float


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class Waits:
    """Which requests wait for their prefix to land, up to ``bound_s`` each (0: none ever)."""

    def __init__(
        self,
        bound_s: float,
        report: Callable[[float, str], None],
        clock: Callable[[], float] = time.monotonic,
        reask_s: float = REASK_S,
    ) -> None:
        self.bound_s = bound_s
        self._report = report
        self._clock = clock
        self.reask_s = reask_s
        self._waits: dict[str, _Wait] = {}

    def too_soon(self, req_id: str) -> bool:
        """A waiting request asked less than ``reask_s`` ago: answer "not yet" without asking."""
        w = self._waits.get(req_id)
        return w is not None and self._clock() < w.next_ask

    def decide(self, req_id: str, found: LookupFound, own: int, limit: int, computed: int = 0) -> int | None:
        """The tokens to load now (``found.hit`` up to ``limit``), or None: ask again later,
        since up to ``max(found.hit + found.pending, own)`` tokens are on their way and more of
        them than the engine's own cache holds (``computed``: waiting for what it has is no gain)."""
        now = self._clock()
        hit = min(found.hit, limit)
        reach = min(max(found.hit + found.pending, own), limit) if found.answered else hit
        w = self._waits.get(req_id)
        if reach > max(hit, computed) and self.bound_s > 0:
            if w is None:
                w = self._waits[req_id] = _Wait(now, reach, now)
            w.want = max(w.want, reach)
            if now - w.start < self.bound_s:
                w.next_ask = now + self.reask_s
                return None
            outcome = "gave_up"
        elif w is None:
            return hit  # nothing on its way: never delayed
        else:
            outcome = "hit" if hit >= w.want else "partial"
        del self._waits[req_id]
        self._report(now - w.start, outcome)
        return hit

    def idle_s(self) -> float:
        """Seconds until the first waiting request may ask again (0: none waits). An engine
        whose step schedules nothing sleeps this long rather than spin: vLLM steps again at once
        while a request waits, and a spinning engine takes the cores that the store it waits
        for, and a dead store's teardown, need."""
        if not self._waits:
            return 0.0
        return max(0.0, min(w.next_ask for w in self._waits.values()) - self._clock())

    def forget(self, req_id: str) -> None:
        """The request is gone (finished, aborted) while it waited: no outcome to report."""
        self._waits.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._waits)
