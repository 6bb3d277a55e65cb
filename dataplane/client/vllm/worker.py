"""The worker side of kvwarden's vLLM connector, without vLLM: registration that outlives a
missing server, stores off the step's path, loads that say which blocks they could not fill,
made on the step or, for vLLM's asynchronous loads, on a thread of their own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
import torch

from dataplane.client.adapter import WorkerAdapter
from dataplane.client.vllm.lookup import Scope
from dataplane.client.vllm.state import Load, Save
from dataplane.client.vllm.tail import real_length
from dataplane.client.vllm.tally import Tally
from dataplane.memory.copies import _MAX_RUNS, slot_runs
from dataplane.memory.kvmemory import DTYPE_NAMES
from dataplane.wire.errors import KVWardenError, RequestError
from dataplane.wire.messages import KVFormat

logger = logging.getLogger(__name__)

J = TypeVar("J")  # a job
D = TypeVar("D")  # what a job over reports


class Registrar:
    """Registers the worker's KV memory (thread ``kvwarden-vllm-register``), retrying every
    ``retry_s`` while the server cannot be reached, so an engine may start before its server.
    A refusal (the layout, the chunk size) is final: ``error`` holds it and nothing retries.
    ``_cond`` guards ``registered``, ``error`` and ``_stopped``."""

    def __init__(
        self, adapter: WorkerAdapter, caches: Sequence[torch.Tensor], kv_format: str, retry_s: float
    ) -> None:
        self.adapter = adapter
        self.caches = list(caches)
        self.kv_format = kv_format
        self.retry_s = retry_s
        self._cond = threading.Condition()
        self.registered = False
        self.error: Exception | None = None
        self._stopped = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvwarden-vllm-register", daemon=True)
        self._thread.start()

    def wait(self, timeout_s: float) -> bool:
        """Until registered, refused or ``timeout_s``; True when registered."""
        with self._cond:
            self._cond.wait_for(lambda: self.registered or self.error is not None, timeout_s)
            return self.registered

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def join(self, timeout_s: float = 10.0) -> bool:
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        warned = False
        while True:
            with self._cond:
                if self._stopped:
                    return
            try:
                self.adapter.register_kv_caches(self.caches, self.kv_format)
            except (RequestError, ValueError) as exc:  # refused: retrying cannot help
                with self._cond:
                    self.error = exc
                    self._cond.notify_all()
                logger.error("kvwarden: registration refused: %s", exc)
                return
            except KVWardenError as exc:
                if not warned:
                    logger.warning(
                        "kvwarden: server not reachable (%s): requests recompute until it is; retrying "
                        "every %gs",
                        exc,
                        self.retry_s,
                    )
                    warned = True
                with self._cond:
                    if self._cond.wait_for(lambda: self._stopped, self.retry_s):
                        return
                continue
            with self._cond:
                self.registered = True
                self._cond.notify_all()
            if warned:
                logger.info("kvwarden: registered with the server")
            return


class _JobThread(Generic[J, D]):
    """A queue of jobs run one after another on a thread of its own (``name``), and what each
    job left to report, handed over by ``take_done``. ``stop`` ends the thread (how it treats
    jobs still queued is the subclass's ``_run``); ``join`` waits for it. ``_cond`` guards
    ``_queue``, ``_done`` and ``_stopped``, and whatever the subclass says it does too."""

    name: ClassVar[str]

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: deque[J] = deque()
        self._done: list[D] = []  # reports of jobs over, not yet taken
        self._stopped = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def take_done(self) -> list[D]:
        """What the jobs over since the last call reported."""
        with self._cond:
            done, self._done = self._done, []
            return done

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def join(self, timeout_s: float = 30.0) -> bool:
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        raise NotImplementedError


class Saver(_JobThread[Save, int]):
    """Stores planned chunks on thread ``kvwarden-vllm-saver`` while the engine steps on.

    A request whose chunks are being stored keeps its blocks (the scheduler holds them) until
    ``finished`` reports it. Every save over, stored or failed, is reported by its sequence
    number (``take_done``), so the scheduler stops counting it as on its way. ``stop`` lets
    the saves queued run first. ``store`` False: saves are reported over without storing (a
    rank whose bytes another rank stores for it). ``_cond`` also guards ``_pending``, ``_asked``
    and ``_busy``."""

    name = "kvwarden-vllm-saver"

    def __init__(
        self, adapter: WorkerAdapter, store: bool = True, more: Sequence[WorkerAdapter] = ()
    ) -> None:
        super().__init__()
        self.adapter = adapter
        self.more = list(more)  # the other KV cache groups' instances (`Save.more`), in order
        self.store = store
        self._pending: dict[str, int] = {}  # req id -> saves queued or running
        self._asked: set[str] = set()  # finished requests whose saves were planned
        self._busy = False
        self.stored_chunks = 0
        self.failed = 0
        self.tally = Tally()  # (vLLM's connector stats: the connector gives its own)
        self.token_bytes: Sequence[int] = ()  # KV bytes a token, each group's (for the tally)

    def submit(self, saves: Sequence[Save]) -> None:
        with self._cond:
            for s in saves:
                self._queue.append(s)
                self._pending[s.req_id] = self._pending.get(s.req_id, 0) + 1
            self._cond.notify_all()

    def finished(self, finished_req_ids: set[str], planned: set[str]) -> set[str]:
        """Of the finished requests whose saves were planned (``planned``: every request this
        worker was asked to save, ever), those whose saves are over."""
        with self._cond:
            self._asked |= finished_req_ids & planned
            done = {r for r in self._asked if not self._pending.get(r)}
            self._asked -= done
            return done

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued save is over (blocks about to be reused); True if so."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopped)
                if not self._queue:
                    return  # stopped, and nothing left to store
                job = self._queue.popleft()
                self._busy = True
            try:
                self._store(job)
            finally:
                with self._cond:
                    self._pending[job.req_id] -= 1
                    if not self._pending[job.req_id]:
                        del self._pending[job.req_id]
                    if job.seq:
                        self._done.append(job.seq)
                    self._busy = False
                    self._cond.notify_all()

    def _store(self, job: Save) -> None:
        if not self.store:
            return  # another rank stores these bytes
        for i, (adapter, part) in enumerate(zip([self.adapter, *self.more], job.parts(), strict=True)):
            if adapter.registration is None:
                continue  # not registered (yet): nothing to store into
            cs = adapter.chunk_size or 0
            if cs and part.first >= len(job.tokens) // cs:
                continue  # a part from past the full chunks stores nothing (no round trip for it)
            try:
                names = job.names if adapter is self.adapter else None  # (the events name the first group's)
                r = adapter.store_detail(job.tokens, part.blocks, job.key, names, part.first)
            except (KVWardenError, ValueError) as exc:
                self.failed += 1
                self.tally.add(failed_stores=1)
                logger.warning("kvwarden: store of request %s failed: %s", job.req_id, exc)
                return
            self.stored_chunks += r.stored
            size = self.token_bytes[i] if i < len(self.token_bytes) else 0
            self.tally.add(stored_chunks=r.stored, stored_bytes=r.stored * cs * size)


class Loader(_JobThread[Load, tuple[str, set[int]]]):
    """Loads requests off the step on thread ``kvwarden-vllm-loader`` (vLLM's asynchronous
    loads): the request waits in WAITING_FOR_REMOTE_KVS while the engine steps on, and
    ``take_done`` hands each load over, as (request id, the blocks it could not fill), to the
    step that reports it (``get_finished``, then ``get_block_ids_with_load_errors``). Loads run
    one after another, in the order planned; ``stop`` ends them after the one in progress, and
    those still queued report every block unfilled."""

    name = "kvwarden-vllm-loader"

    def __init__(
        self,
        adapter: WorkerAdapter,
        block_size: int,
        copy: BlockCopier | None = None,
        more: Sequence[WorkerAdapter] = (),
    ) -> None:
        super().__init__()
        self.adapter = adapter
        self.more = list(more)  # the other KV cache groups' instances (`Load.more`), in order
        self.block_size = block_size
        self.copy = copy
        self.tally = Tally()  # (vLLM's connector stats: the connector gives its own)
        self.token_bytes: Sequence[int] = ()  # KV bytes a token, each group's (for the tally)

    def submit(self, loads: Sequence[Load]) -> None:
        with self._cond:
            self._queue.extend(loads)
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopped)
                if self._stopped:
                    for job in self._queue:
                        self._done.append((job.req_id, _blocks_from(job, 0, self.block_size)))
                    self._queue.clear()
                    return
                job = self._queue.popleft()
            try:
                missing = load(
                    self.adapter, job, self.block_size, self.copy, self.more, self.tally, self.token_bytes
                )
            except Exception as exc:  # a load that breaks is recomputed, never served half-made
                logger.warning("kvwarden: background load of request %s failed: %r", job.req_id, exc)
                missing = _blocks_from(job, 0, self.block_size)
            with self._cond:
                self._done.append((job.req_id, missing))


def _blocks_from(job: Load, tokens: int, block_size: int) -> set[int]:
    """The blocks of ``job`` from the one holding token ``tokens`` to its last token's (none of
    those it leaves alone, -1: a tail chunk's past the prompt)."""
    first, last = tokens // block_size, -(-len(job.tokens) // block_size)
    return {int(b) for b in np.asarray(job.blocks[first:last]) if b >= 0}


class BlockCopier:
    """Copies whole blocks of the worker's KV caches onto other blocks of the same caches: a
    prefix this engine is still saving, into the blocks of a request with that prefix. Runs of
    consecutive blocks move as one slice (one pass over the bytes); many runs, or a GPU, as
    one indexed copy per layer."""

    MAX_RUNS = _MAX_RUNS

    def __init__(self, caches: Sequence[torch.Tensor], block_dim: int) -> None:
        self.caches = list(caches)
        self.block_dim = block_dim

    def __call__(self, src: np.ndarray, dst: np.ndarray) -> None:
        src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source blocks for {len(dst)} blocks")
        runs = slot_runs(src, dst)
        dim = self.block_dim
        if len(runs) > self.MAX_RUNS or self.caches[0].device.type != "cpu":
            device = self.caches[0].device
            s, d = torch.from_numpy(src).to(device), torch.from_numpy(dst).to(device)
            for t in self.caches:
                t.index_copy_(dim, d, t.index_select(dim, s))
            return
        for t in self.caches:
            for to, start, n in runs:
                t.narrow(dim, to, n).copy_(t.narrow(dim, start, n))


def load(
    adapter: WorkerAdapter | None,
    job: Load,
    block_size: int,
    copy: BlockCopier | None = None,
    more: Sequence[WorkerAdapter] = (),
    tally: Tally | None = None,
    token_bytes: Sequence[int] = (),
) -> set[int]:
    """Write ``job``'s prefix into its blocks: copied from this worker's own blocks when the job
    names them (``job.source``), else retrieved, each KV cache group's part by its own instance
    (``more``: the groups after the first). Returns the first group's blocks from the first
    token some group could not fill (empty when all came; all of them with no adapter or an
    unregistered one). A miss is not an error: the scheduler recomputes those blocks. Counted
    in ``tally``: the load, its time, its tokens and (``token_bytes``: each group's KV bytes a
    token) the bytes it moved."""
    t0 = time.perf_counter()
    want = len(job.tokens)
    real = real_length(job.tokens)  # (a tail chunk's marks are no tokens: `dataplane.client.vllm.tail`)
    if job.source is not None and copy is not None:
        copy(job.source, job.blocks[: len(job.source)])
        if tally is not None:
            tally.add(loads_full=1, loaded_tokens=want)
            tally.load_took(time.perf_counter() - t0)
        return set()
    got, moved = want, 0
    for i, (a, part) in enumerate(zip([adapter, *more], job.parts(), strict=True)):
        filled = 0
        if a is not None and a.registration is not None:
            try:
                filled = a.retrieve(job.tokens, part.blocks, job.key, part.first)
            except (KVWardenError, ValueError) as exc:
                logger.warning("kvwarden: load of request %s failed: %s", job.req_id, exc)
            size = token_bytes[i] if i < len(token_bytes) else 0
            moved += max(0, filled - part.first * (a.chunk_size or 0)) * size  # (a tail's whole chunk)
        got = min(got, filled)
        if got < want:
            break  # (the hit is cut short: the rest is recomputed)
    if tally is not None:
        tally.add(
            loads_full=int(got >= want),
            loads_short=int(got < want),
            loaded_tokens=min(got, real),
            loaded_bytes=moved,
        )
        tally.load_took(time.perf_counter() - t0)
    return set() if got >= want else _blocks_from(job, got, block_size)


def kv_groups(
    kv_caches: dict[str, torch.Tensor], want: torch.dtype, group_layers: list[list[str]], n_groups: int
) -> list[list[torch.Tensor]]:
    """vLLM's KV tensors, a list a KV cache group (each group's layers in its order: vLLM's
    hybrid manager may share one tensor among groups), fp8 KV, which vLLM keeps as bytes, viewed
    as what it is (``want``)."""
    fp8 = want in (torch.float8_e4m3fn, torch.float8_e5m2)

    def as_kv(t: torch.Tensor) -> torch.Tensor:
        return t.view(want) if fp8 and t.dtype == torch.uint8 else t

    if n_groups == 1:
        return [[as_kv(t) for t in kv_caches.values()]]
    return [[as_kv(kv_caches[name]) for name in layers] for layers in group_layers]


def allow_amx() -> None:
    """Ask the kernel for this process's use of AMX tiles, where the CPU has them. vLLM's CPU
    attention uses AMX on such hosts, and a process that never asked dies of SIGILL at its
    first AMX instruction: a worker whose first forward pass follows a load (a decode engine
    given a whole prompt's KV) reaches vLLM's AMX kernel before anything that asks."""
    cpu = getattr(torch, "cpu", None)
    supported = getattr(cpu, "_is_amx_tile_supported", None)
    init = getattr(cpu, "_init_amx", None)
    if supported is not None and init is not None and supported():
        init()


def layout(caches: Sequence[torch.Tensor], s: Scope, mode: str) -> tuple[str, KVFormat]:
    """The transfer mode (``mode``, "auto" resolved) and format of vLLM's tensors of one KV
    cache group, checked against the scope the scheduler looks up (a mismatch would make every
    lookup miss)."""
    first = caches[0]
    kv_format: KVFormat
    if first.dim() == 4 and first.device.type == "cpu":
        kv_format = s.kv_format if s.kv_format is not KVFormat.TOKEN_MAJOR else KVFormat.VLLM_CPU
        heads, bs, head_dim = first.shape[1], first.shape[2], first.shape[3] // kv_format.planes
    elif first.dim() == 5 and first.shape[0] == 2:
        kv_format, heads, bs, head_dim = KVFormat.TOKEN_MAJOR, first.shape[3], first.shape[2], first.shape[4]
    else:
        raise ValueError(f"kvwarden: KV cache tensors of shape {list(first.shape)} are not a layout it knows")
    seen = (DTYPE_NAMES.get(first.dtype), len(caches), int(heads), int(head_dim), kv_format, int(bs))
    want = (s.dtype, s.num_layers, s.heads, s.head_dim, s.kv_format, s.block_size)
    if seen != want:
        raise ValueError(
            f"kvwarden: the KV tensors (dtype, layers, heads, head dim, format, block) {seen} "
            f"differ from the engine's configuration {want}"
        )
    if mode == "auto":
        mode = "server_driven" if first.device.type == "cuda" else "engine_driven"
    return mode, kv_format


def register_groups(
    scopes: Sequence[Scope],
    groups: Sequence[Sequence[torch.Tensor]],
    rank: int,
    url: str,
    mode: str,
    wait_s: float,
    options: dict[str, Any],
    retry_s: float,
) -> tuple[list[WorkerAdapter], list[Registrar], KVFormat]:
    """Register each KV cache group's tensors (``groups``, in the order of ``scopes``) by an
    instance of its own: (the instances, their started registrars, the format), once every
    registration is made or still retried in the background after ``wait_s``. A refusal of any
    is final: every instance is closed and ValueError names it. ``options``: more of
    `WorkerAdapter`'s keywords."""
    adapters: list[WorkerAdapter] = []
    registrars: list[Registrar] = []
    kv_format = KVFormat.TOKEN_MAJOR
    for scope, caches in zip(scopes, groups, strict=True):
        group_mode, kv_format = layout(caches, scope, mode)
        adapter = WorkerAdapter(
            url, scope.model_name, scope.world_size, rank, transfer_mode=group_mode, **options
        )
        adapters.append(adapter)
        registrars.append(Registrar(adapter, caches, kv_format.value, retry_s))
    for registrar in registrars:
        registrar.start()
    for registrar in registrars:
        registrar.wait(wait_s)
    refused = next((r.error for r in registrars if r.error is not None), None)
    if refused is not None:
        for registrar in registrars:
            registrar.stop()
            registrar.join()
        for adapter in adapters:
            adapter.close()
        raise ValueError(f"kvwarden: registration refused: {refused}") from refused
    return adapters, registrars, kv_format
