"""The parts of kvwarden's vLLM connector that need no vLLM: what the scheduler plans and what the
worker carries out (`dataplane.client.vllm` is the glue vLLM calls).

Scheduler side: ``Planner`` turns vLLM's scheduling decisions into ``Plan`` (which requests load
which whole chunks before the forward pass, which store new full chunks after it), from what
``dataplane.client.vllm.lookup.ScopeLookup`` finds on the server. A request whose prefix is on
its way waits for it (`dataplane.client.vllm.wait`). Worker side (`dataplane.client.vllm.worker`):
``Registrar`` registers the worker's KV memory, now or, when the server is not there yet, in the
background until it is; ``Saver`` stores on a thread of its own (``kvwarden-vllm-saver``) so the
step does not wait for it, and says which finished requests' blocks may be freed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from dataplane.client.vllm.tail import padded, tail_blocks, tail_end
from dataplane.client.vllm.tally import Tally
from dataplane.client.vllm.wait import LookupFound, OwnSaves, Source, Waits
from dataplane.wire.blocks import EngineBlocks
from dataplane.wire.messages import KeyContext

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


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
        self.stores = True  # False: no save is ever planned (vLLM's kv_role kv_consumer)
        self.loads = True  # False: nothing is ever loaded, or looked up (kv_producer)
        # a computed prompt's tail is stored too (`dataplane.client.vllm.tail`: a kv_producer's
        # kvwarden.store_tail); a handoff that names one is loaded with it (the worker's loads
        # can leave a chunk's blocks past the prompt alone)
        self.store_tail = False
        self.load_tail = False
        self.waits = waits if waits is not None else Waits(0.0, lambda s, o: None)
        self.own = own if own is not None else OwnSaves()
        self.tally = Tally()  # (vLLM's connector stats: the connector gives its own)
        self._hits: dict[str, int] = {}  # req id -> hit tokens (decided once per request)
        self._sources: dict[str, Source] = {}  # req id -> the own save its hit copies from
        self._in_l1: dict[str, int] = {}  # req id -> of its hit, the tokens the server held in L1
        self._on_disk: dict[str, int] = {}  # req id -> of its hit, those after that its file tier held
        self._own_copy: set[str] = set()  # requests whose hit is copied from this engine's blocks
        self.keys: dict[str, RequestKey] = {}  # req id -> its key context (or UNCACHED)
        self.names: dict[str, EngineBlocks | None] = {}  # req id -> vLLM's names of its blocks
        self._reqs: dict[str, _Request] = {}
        self.loading: set[str] = set()  # background loads planned, not yet reported over

    def matched(
        self,
        req_id: str,
        prompt: Sequence[int] | None,
        computed: int,
        key: RequestKey = None,
        expected: int = 0,
    ) -> int | None:
        """Tokens beyond ``computed`` that kvwarden will load; None: not decided yet (chunks of
        the prompt are being stored), ask again on a later step. ``expected``: tokens of the
        prompt a producer said it stored (a disaggregated prefill's handoff): waited for, within
        the bound, as chunks on their way are, though the server does not see them yet."""
        self.keys[req_id] = key  # (what its saves are keyed on, loads or not)
        if not self.loads and self.chunk_size() is None:
            self.lookup(np.zeros(0, dtype=np.int64), None)  # (an empty lookup: the server's chunk size)
        if not prompt or isinstance(key, Uncached) or not self.loads:
            return 0
        hit = self._hits.get(req_id)
        if hit is None:
            if self.waits.too_soon(req_id):
                return None
            decided = self._decide(req_id, np.asarray(prompt, dtype=np.int64), key, computed, expected)
            if decided is None:
                return None
            hit = self._hits[req_id] = decided
        return max(0, hit - computed)

    def _decide(
        self, req_id: str, tokens: np.ndarray, key: KeyContext | None, computed: int = 0, expected: int = 0
    ) -> int | None:
        """The hit, or None: wait. A prefix this engine is saving is copied from the saved
        request's blocks at once, without asking the server when it covers all that could be
        loaded, else when it covers at least what the server holds."""

        def limit() -> int:  # (the chunk size is learnt from the server's first answer)
            cs = self.chunk_size()
            return 0 if cs is None else max(0, len(tokens) - self.tail) // cs * cs

        end = self._handed_tail(tokens, expected)
        if end:
            return self._decide_tail(req_id, tokens, key, computed, end)
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
            self._own_copy.add(req_id)
            return self._count(self.waits.decide(req_id, LookupFound(local), 0, most), True)  # (ends a wait)
        own = 0 if cs is None or not len(self.own) else self.own.reach(tokens, key) // cs * cs
        if expected and cs is not None:
            own = max(own, expected // cs * cs)  # (the producer's chunks: on their way)
        self._own_copy.discard(req_id)
        self._in_l1[req_id], self._on_disk[req_id] = found.l1, found.fs
        return self._count(self.waits.decide(req_id, found, own, most, computed), found.answered)

    def _handed_tail(self, tokens: np.ndarray, expected: int) -> int:
        """Where the tail a producer's handoff names ends (``expected``: all of the prompt but
        the tokens vLLM computes itself), when this engine can load it; else 0."""
        if not self.load_tail or not expected:
            return 0
        if self.chunk_size() is None:
            self.lookup(np.zeros(0, dtype=np.int64), None)  # (an empty lookup: the server's chunk size)
        cs = self.chunk_size()
        if cs is None or cs % self.block_size:
            return 0
        end = tail_end(len(tokens), self.tail, cs)
        return end if end == expected else 0

    def _decide_tail(
        self, req_id: str, tokens: np.ndarray, key: KeyContext | None, computed: int, end: int
    ) -> int | None:
        """A handoff that names the prompt's tail: the prefix and its tail chunk, waited for
        within the bound as a producer's chunks are; ``end`` when all of it is held, else the
        full chunks held."""
        cs = self.chunk_size() or 1
        want = padded(tokens, end, cs)
        found = self.lookup(want, key)
        self._own_copy.discard(req_id)
        self._in_l1[req_id], self._on_disk[req_id] = found.l1, found.fs
        decided = self.waits.decide(req_id, found, len(want), len(want), computed)
        if decided is not None and decided >= len(want):
            decided = end  # (the tail chunk holds the tokens up to ``end``)
        return self._count(decided, found.answered)

    def _count(self, decided: int | None, answered: bool) -> int | None:
        """Count a request's lookup once decided (vLLM's connector stats)."""
        if decided is not None:
            outcome = "hit" if decided else "miss" if answered else "unanswered"
            self.tally.add(**{f"lookups_{outcome}": 1})
        return decided

    def from_lower_tiers(self, req_id: str) -> bool:
        """Whether the hit ``matched`` found reaches past what the server held in L1 when asked
        (a load that reads the file tier or Redis, not a memory copy alone)."""
        return self._hits.get(req_id, 0) > self._in_l1.get(req_id, 0)

    def hit_sources(self, req_id: str, computed: int, n: int) -> dict[str, int]:
        """Where the ``n`` tokens after ``computed`` that the request loads come from, as the
        server told when asked: ``device`` (this engine's own blocks, a save on its way),
        ``host`` (the server's L1), ``disk`` (its file tier), ``remote`` (the rest: Redis, or
        a chunk stored while the request waited); only non-zero counts."""
        if n <= 0:
            return {}
        if req_id in self._own_copy:
            return {"device": n}
        l1 = self._in_l1.get(req_id, 0)
        disk = l1 + self._on_disk.get(req_id, 0)
        end = computed + n

        def part(lo: int, hi: int) -> int:
            return max(0, min(hi, end) - max(lo, computed))

        got = {"host": part(0, l1), "disk": part(l1, disk)}
        got["remote"] = n - got["host"] - got["disk"]
        return {k: v for k, v in got.items() if v > 0}

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
        head, tokens = parts[0], r.tokens[: r.load]
        if r.load % cs:  # a tail chunk: its blocks past the prompt are left alone
            tokens = padded(r.tokens, r.load, cs)
            head = Part(tail_blocks(head.blocks, r.load, cs, self.block_size, store=False), head.first)
        return Load(req_id, tokens, head.blocks, r.key, copy, background, head.first, tuple(parts[1:]))

    def _save(self, out: Plan, req_id: str, r: _Request, computed: int, done: int) -> None:
        """Store the chunks ``r`` completed by ``done`` tokens (``computed`` when its step
        began). A sliding-window group stores from the first chunk whose blocks vLLM still
        holds: none of vLLM's null blocks, and none it may free before the save is over (those
        of tokens before its window at the step's start)."""
        cs = self.chunk_size()
        if cs is None or not self.stores:
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
        if self.store_tail and done >= len(r.tokens) and cs % self.block_size == 0:
            self._save_tail(out, req_id, r, cs)

    def _save_tail(self, out: Plan, req_id: str, r: _Request, cs: int) -> None:
        """Store the computed prompt's tail as a chunk of its own (`dataplane.client.vllm.tail`),
        once its full chunks are planned; not named in the engine's KV events (vLLM names only
        full blocks)."""
        end = tail_end(len(r.tokens), self.tail, cs)
        if end <= r.saved:
            return
        tokens = padded(r.tokens, end, cs)
        blocks = tail_blocks(np.asarray(r.blocks[0], dtype=np.int64), end, cs, self.block_size, store=True)
        seq = self.own.add(tokens, r.key, req_id, None)
        out.saves.append(Save(req_id, tokens, blocks, r.key, seq, None, end // cs))
        r.saved, r.saving = end, True

    def stored(self, req_id: str) -> int:
        """Prompt tokens this engine stored, or asked its workers to store, of the request."""
        r = self._reqs.get(req_id)
        return 0 if r is None else r.saved

    def finished(self, req_id: str) -> bool:
        """The request is done: True when a save was planned for it, or its background load is
        not over (its blocks are freed once the worker says so)."""
        self._hits.pop(req_id, None)
        self._in_l1.pop(req_id, None)
        self._on_disk.pop(req_id, None)
        self._own_copy.discard(req_id)
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
