"""The parts of kvwarden's vLLM connector that need no vLLM: what the scheduler plans and what the
worker carries out (`dataplane.client.vllm` is the glue vLLM calls).

Scheduler side: ``ScopeLookup`` asks the server how much of a prompt it holds and how much more
is being stored (LOOKUP_SCOPE: the scheduler registers no memory, it names the scope its workers
register) and ``Planner`` turns vLLM's scheduling decisions into ``Plan``: which requests load
which whole chunks before the forward pass, which store new full chunks after it. A request
whose prefix is on its way waits for it (`dataplane.client.vllm.wait`). Worker side: ``Registrar`` registers
the worker's KV memory, now or, when the server is not there yet, in the background until it
is; ``Saver`` stores on a thread of its own (``kvwarden-vllm-saver``) so the step does not wait
for it, and says which finished requests' blocks may be freed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from dataplane.client.channel import Channel, R
from dataplane.client.vllm.wait import LookupFound, OwnSaves, Source, Waits
from dataplane.wire.blocks import EngineBlocks
from dataplane.wire.errors import KVWardenError, RequestError

if TYPE_CHECKING:
    import torch

from dataplane.wire.messages import (
    MAX_WAIT_S,
    KeyContext,
    KVFormat,
    LookupScope,
    LookupWaited,
    Message,
    PrefetchScope,
)

logger = logging.getLogger(__name__)


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

    def window_chunks(self, chunk_size: int) -> int:
        """The last chunks before a hit's end that the group needs (0: all of them)."""
        return 0 if not self.window else max(1, -(-(self.window - 1) // chunk_size))

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
        l1 = len(tokens)
        for s in full:
            r = self._ask(LookupScope(*self._scope_fields(s), tokens, key))
            if r is None:
                return LookupFound(0, 0, answered=False)
            self._learn(r.chunk_size)
            hit, reach, l1 = (
                min(hit, r.hit_tokens),
                min(reach, r.hit_tokens + r.pending_tokens),
                min(l1, r.l1_tokens),
            )
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
                    r = self._ask(LookupScope(*self._scope_fields(s), tokens[:hit], key, s.window_chunks(cs)))
                    if r is None:
                        return LookupFound(0, 0, answered=False)
                    reach = min(reach, r.hit_tokens + r.pending_tokens)
                    l1 = min(l1, r.l1_tokens)
                    if r.hit_tokens < hit:
                        hit, lowered = r.hit_tokens, True
                        if not hit:
                            break
        return LookupFound(hit, max(0, reach - hit), l1=min(l1, hit))

    def _learn(self, chunk_size: int) -> None:
        with self._lock:
            self.chunk_size = chunk_size

    def _chunk_size_now(self, tokens: np.ndarray, key: KeyContext | None) -> int | None:
        """The server's chunk size, asked with a lookup of no window (a sliding-window group's
        window is counted in chunks)."""
        r = self._ask(LookupScope(*self._scope_fields(self.scope), tokens[:0], key))
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
            self._ask(PrefetchScope(*self._scope_fields(s), tokens, key, window))

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


@dataclass(frozen=True)
class Part:
    """Another KV cache group's share of a load or a save (`Load.more`, `Save.more`): its
    blocks (-1: vLLM's null block, never written) and the first chunk it moves."""

    blocks: np.ndarray
    first: int = 0


@dataclass
class Load:
    """Before the forward pass: write the held prefix ``tokens`` into ``blocks`` (the first KV
    cache group's), from chunk ``first`` on, and each other group's part (``more``)."""

    req_id: str
    tokens: np.ndarray
    blocks: np.ndarray
    key: KeyContext | None = None  # the request's salt, adapter, ... (`dataplane.client.keys`)
    # blocks of this engine that hold the same KV (a save of the same prefix still on its way):
    # the worker copies them block to block instead of asking the server
    source: np.ndarray | None = None
    # loaded off the step (vLLM's asynchronous loads): the request waits in
    # WAITING_FOR_REMOTE_KVS while others run, and the worker reports it through get_finished
    background: bool = False
    first: int = 0  # a sliding-window group: the first chunk its window needs
    more: tuple[Part, ...] = ()

    def parts(self) -> list[Part]:
        """Each KV cache group's blocks and first chunk, in order."""
        return [Part(self.blocks, self.first), *self.more]


@dataclass
class Save:
    """After the forward pass: store the full chunks of ``tokens`` (from ``blocks``, the first
    KV cache group's, from chunk ``first`` on; each other group's part: ``more``)."""

    req_id: str
    tokens: np.ndarray
    blocks: np.ndarray
    key: KeyContext | None = None
    seq: int = 0  # reported back to the scheduler when the save is over (`OwnSaves`)
    names: EngineBlocks | None = None  # vLLM's names of the blocks, for kvwarden's KV events
    first: int = 0
    more: tuple[Part, ...] = ()

    def parts(self) -> list[Part]:
        """Each KV cache group's blocks and first chunk, in order."""
        return [Part(self.blocks, self.first), *self.more]


class Uncached:
    """A request whose KV depends on something no key can name: it neither loads nor stores."""


UNCACHED = Uncached()
RequestKey = KeyContext | None | Uncached


@dataclass
class Plan:
    loads: list[Load] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)
    preempted: bool = False  # blocks of some request go back this step: no save may still read them
    # nothing else to do this step while requests wait for this engine's own saves: the worker
    # finishes them before it answers (its thread sleeps meanwhile rather than spin on the core
    # the saves run on), so they land, and are reported, a step sooner
    flush_saves: bool = False


Groups = Sequence[Sequence[int]]  # a request's block ids, one list a KV cache group


@dataclass
class _Request:
    tokens: np.ndarray  # the prompt
    blocks: list[list[int]]  # one list a KV cache group
    key: KeyContext | None
    saved: int = 0  # prompt tokens kvwarden holds or has been asked to store
    load: int = 0  # tokens to load before the first forward pass
    saving: bool = False  # a Save was planned: its blocks wait for the worker's word
    source: Source | None = None  # where the load may copy from (`OwnSaves.source`)
    background: bool = False  # vLLM loads it asynchronously: planned before it is scheduled


class Planner:
    """The scheduler's bookkeeping (called on vLLM's scheduler thread only). Loads and stores
    are whole chunks of the prompt; a load never covers the prompt's last ``tail`` tokens (vLLM
    must compute at least one). Each request's key context is the one ``matched`` was given: a
    request never seen there, or ``UNCACHED``, neither loads nor stores. A request whose prefix
    is being stored (`dataplane.client.vllm.wait`) is answered None by ``matched`` until it
    lands or ``waits.bound_s`` passes."""

    def __init__(
        self,
        lookup: Callable[[np.ndarray, KeyContext | None], LookupFound],
        block_size: int,
        waits: Waits | None = None,
        own: OwnSaves | None = None,
    ) -> None:
        self.lookup = lookup
        self.block_size = block_size
        self.chunk_size: Callable[[], int | None] = lambda: None
        # the fewest prompt tokens a hit leaves vLLM to compute (it must compute the last one)
        self.tail = 1
        # each KV cache group's sliding window in tokens (0: full attention), in vLLM's order
        self.windows: tuple[int, ...] = (0,)
        self.waits = waits if waits is not None else Waits(0.0, lambda s, o: None)
        self.own = own if own is not None else OwnSaves()
        self._hits: dict[str, int] = {}  # req id -> hit tokens (decided once per request)
        self._sources: dict[str, Source] = {}  # req id -> the own save its hit copies from
        self._in_l1: dict[str, int] = {}  # req id -> of its hit, the tokens the server held in L1
        self.keys: dict[str, RequestKey] = {}  # req id -> its key context (or UNCACHED)
        self.names: dict[str, EngineBlocks | None] = {}  # req id -> vLLM's names of its blocks
        self._reqs: dict[str, _Request] = {}
        self.loading: set[str] = set()  # background loads planned, not yet reported over

    def matched(
        self, req_id: str, prompt: Sequence[int] | None, computed: int, key: RequestKey = None
    ) -> int | None:
        """Tokens beyond ``computed`` that kvwarden will load; None: not decided yet (chunks of
        the prompt are being stored), ask again on a later step."""
        self.keys[req_id] = key
        if not prompt or isinstance(key, Uncached):
            return 0
        hit = self._hits.get(req_id)
        if hit is None:
            if self.waits.too_soon(req_id):
                return None
            decided = self._decide(req_id, np.asarray(prompt, dtype=np.int64), key, computed)
            if decided is None:
                return None
            hit = self._hits[req_id] = decided
        return max(0, hit - computed)

    def _decide(
        self, req_id: str, tokens: np.ndarray, key: KeyContext | None, computed: int = 0
    ) -> int | None:
        """The hit, or None: wait. A prefix this engine is saving is copied from the saved
        request's blocks at once, without asking the server when it covers all that could be
        loaded, else when it covers at least what the server holds."""

        def limit() -> int:  # (the chunk size is learnt from the server's first answer)
            cs = self.chunk_size()
            return 0 if cs is None else max(0, len(tokens) - self.tail) // cs * cs

        cs, most = self.chunk_size(), limit()
        src = self.own.source(tokens, key) if most and len(self.own) else None
        local = 0 if src is None or cs is None else min(src.tokens // cs * cs, most)
        if local and local == most:
            found = LookupFound(local)  # it covers all that could load: the server is not asked
        else:
            found = self.lookup(tokens[: max(0, len(tokens) - self.tail)], key)
            cs, most = self.chunk_size(), limit()
        if src is not None and local and local >= found.hit:
            self._sources[req_id] = src
            return self.waits.decide(req_id, LookupFound(local), 0, most)  # (ends a wait, if any)
        own = 0 if cs is None or not len(self.own) else self.own.reach(tokens, key) // cs * cs
        self._in_l1[req_id] = found.l1
        return self.waits.decide(req_id, found, own, most, computed)

    def from_lower_tiers(self, req_id: str) -> bool:
        """Whether the hit ``matched`` found reaches past what the server held in L1 when asked
        (a load that reads the file tier or Redis, not a memory copy alone)."""
        return self._hits.get(req_id, 0) > self._in_l1.get(req_id, 0)

    def copies_own(self, req_id: str) -> bool:
        """Whether the hit ``matched`` found is copied from this engine's own blocks (a save on
        its way): a local copy, made on the step, never in the background."""
        return req_id in self._sources

    def allocated(
        self, req_id: str, prompt: Sequence[int] | None, external: int, blocks: Groups | None = None
    ) -> None:
        """vLLM allocated blocks for ``external`` tokens to load: the hit ``matched`` found.
        ``blocks``: the request's blocks, when vLLM loads it asynchronously (it is not scheduled
        this step: the next plan loads it in the background)."""
        hit = self._hits.get(req_id, 0)
        key = self.keys.get(req_id)
        src = self._sources.pop(req_id, None)
        if external > 0 and prompt and hit and not isinstance(key, Uncached):
            r = _Request(np.asarray(prompt, dtype=np.int64), [], key, load=hit, source=src)
            if blocks is not None and src is None:
                r.blocks, r.background = [list(b) for b in blocks], True
            self._reqs[req_id] = r

    def loaded(self, req_ids: Iterable[str]) -> None:
        """The workers report these background loads over (vLLM's ``finished_recving``)."""
        self.loading.difference_update(req_ids)

    def plan(
        self,
        new: Sequence[tuple[str, Sequence[int] | None, Groups, int, int]],
        cached: Sequence[tuple[str, Groups | None, bool, int, int]],
        preempted: bool,
        preempted_ids: Iterable[str] = (),
    ) -> Plan:
        """``new``: (req id, prompt, block ids, computed, scheduled); ``cached``: (req id, new
        block ids, resumed, computed, scheduled), block ids one list a KV cache group;
        ``preempted_ids``: requests whose blocks went back to vLLM this step (never copied from
        again)."""
        out = Plan(preempted=preempted)
        self.own.no_source(preempted_ids)
        scheduled_now = {n[0] for n in new}
        for req_id, waiting in self._reqs.items():
            if waiting.background and waiting.load and req_id not in scheduled_now:
                out.loads.append(self._load(req_id, waiting, None, background=True))
                waiting.saved, waiting.load, waiting.background = waiting.load, 0, False
                self.loading.add(req_id)
        for req_id, prompt, blocks, computed, scheduled in new:
            r = self._reqs.get(req_id)
            if r is None:
                key = self.keys.get(req_id, UNCACHED)  # none known: never stored under a guess
                if not prompt or isinstance(key, Uncached):
                    continue
                r = self._reqs[req_id] = _Request(np.asarray(prompt, dtype=np.int64), [], key)
            r.blocks, r.background = [list(b) for b in blocks], False  # (scheduled now: loaded on this step)
            if r.load:
                src = r.source
                if src is not None and (preempted or not self.own.holds(src.seq)):
                    src = None  # its blocks may have gone back: the server's copy, if it landed
                copy = None if src is None else src.blocks[: -(-r.load // self.block_size)]
                out.loads.append(self._load(req_id, r, copy))
                r.saved, r.load, r.source = r.load, 0, None
            self._save(out, req_id, r, computed, computed + scheduled)
        for req_id, new_blocks, resumed, computed, scheduled in cached:
            r = self._reqs.get(req_id)
            if r is None:
                continue
            if resumed:
                r.blocks = [list(b) for b in new_blocks or [[] for _ in self.windows]]
            elif new_blocks:
                for have, more in zip(r.blocks, new_blocks, strict=True):
                    have.extend(more)
            self._save(out, req_id, r, computed, computed + scheduled)
        return out

    def _load(self, req_id: str, r: _Request, copy: np.ndarray | None, background: bool = False) -> Load:
        """The load of ``r``'s hit: every full-attention group's chunks, each sliding-window
        group's from the first its window needs."""
        cs = self.chunk_size() or 1
        parts = [
            Part(np.asarray(b, dtype=np.int64), 0 if not w else max(0, r.load - w + 1) // cs)
            for b, w in zip(r.blocks, self.windows, strict=True)
        ]
        head = parts[0]
        return Load(
            req_id, r.tokens[: r.load], head.blocks, r.key, copy, background, head.first, tuple(parts[1:])
        )

    def _save(self, out: Plan, req_id: str, r: _Request, computed: int, done: int) -> None:
        """Store the chunks ``r`` completed by ``done`` tokens (``computed`` when its step
        began). A sliding-window group stores from the first chunk whose blocks vLLM still
        holds: none of vLLM's null blocks, and none it may free before the save is over (those
        of tokens before its window at the step's start)."""
        cs = self.chunk_size()
        if cs is None:
            return
        full = min(done, len(r.tokens)) // cs * cs
        if full > r.saved:
            n_blocks = -(-full // self.block_size)
            parts = []
            for ids, w in zip(r.blocks, self.windows, strict=True):
                blocks = np.asarray(ids[:n_blocks], dtype=np.int64)
                first = 0
                if w:
                    nulls = np.flatnonzero(blocks < 0)
                    after_null = 0 if not len(nulls) else -(-(int(nulls[-1]) + 1) * self.block_size // cs)
                    held = -(-max(0, computed - w + 1) // cs)
                    first = max(r.saved // cs, after_null, held)
                parts.append(Part(blocks, first))
            one = self.windows == (0,)  # (several groups, or a window: nothing copies from its blocks)
            seq = self.own.add(r.tokens[:full], r.key, req_id, parts[0].blocks if one else None)
            head = parts[0]
            out.saves.append(
                Save(
                    req_id,
                    r.tokens[:full],
                    head.blocks,
                    r.key,
                    seq,
                    self.names.get(req_id),
                    head.first,
                    tuple(parts[1:]),
                )
            )
            r.saved, r.saving = full, True

    def finished(self, req_id: str) -> bool:
        """The request is done: True when a save was planned for it, or its background load is
        not over (its blocks are freed once the worker says so)."""
        self._hits.pop(req_id, None)
        self._in_l1.pop(req_id, None)
        self._sources.pop(req_id, None)
        self.keys.pop(req_id, None)
        self.names.pop(req_id, None)
        self.waits.forget(req_id)
        r = self._reqs.pop(req_id, None)
        loading = req_id in self.loading
        self.loading.discard(req_id)  # (vLLM frees its blocks at the report it waits for)
        return (r is not None and r.saving) or loading


def prompt_of(token_ids: Sequence[int] | None, embeds: torch.Tensor | None) -> Sequence[int] | None:
    """The prompt's token ids; prompt embeddings' positions hold token 0 (their spans key them)."""
    if token_ids is not None:
        return token_ids
    return [0] * int(embeds.shape[0]) if embeds is not None else None
