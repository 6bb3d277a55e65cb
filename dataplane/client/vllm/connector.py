"""kvwarden as vLLM's KV connector (v1 API): the only module that imports vLLM.

    --kv-transfer-config '{"kv_connector": "KVWardenConnector",
        "kv_connector_module_path": "dataplane.client.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvwarden.url": "tcp://127.0.0.1:5555"}}'

Scheduler side (the engine core): one LOOKUP_SCOPE per new request decides how many whole chunks
of its prompt to load (never its last token); each step's plan says which requests load and
which store new full chunks. A prefix this engine is still saving is copied from the saved
request's blocks at once (`dataplane.client.vllm.wait.OwnSaves.source`); one being stored by
another worker, or by a save that cannot be copied from, is waited for ("not decided yet",
asked again on later steps, up to ``kvwarden.lookup_wait_s``) and loaded once it lands. Worker side:
a hit is loaded off the step (vLLM's asynchronous loads: the request waits in
WAITING_FOR_REMOTE_KVS while others run; a thread of the worker loads it and ``get_finished``
reports it), a copy from this engine's own blocks before the forward pass (``start_load_kv``);
stores go to a thread after it
(``wait_for_save``), and a finished request keeps its blocks until its stores are over
(``request_finished`` / ``get_finished``). A load that comes back short names its blocks
(``get_block_ids_with_load_errors``) so vLLM recomputes them.
With no server, or a server that dies, requests recompute; the worker registers, or registers
again, when the server is back. Chunks are keyed on what vLLM's own prefix cache keys its blocks
on (`request_keys.request_key`: the cache salt, the LoRA adapter with a digest of its files, multimodal
inputs, prompt embeddings), carried to the workers in the plan; a request with anything else
in its block keys is neither loaded nor stored. A model with sliding-window layers or several KV
cache groups (vLLM's hybrid manager on) registers one instance a group and loads only each
window's chunks (`KVWardenConnector`). The planning and the worker's threads need no vLLM:
`dataplane.client.vllm.state` and `dataplane.client.vllm.worker`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from dataplane.client.adapter import WorkerAdapter
from dataplane.client.vllm.events import EventRelay, engine_names
from dataplane.client.vllm.handoff import expected, produced
from dataplane.client.vllm.kinds import cached_scopes, describe, groups_of
from dataplane.client.vllm.lookup import Scope, ScopeLookup
from dataplane.client.vllm.metadata import KVWardenConnectorMetadata, KVWardenWorkerMetadata
from dataplane.client.vllm.request_keys import request_key
from dataplane.client.vllm.settings import adapter_options, connector_settings
from dataplane.client.vllm.state import Plan, Planner, Uncached, prompt_of
from dataplane.client.vllm.tail import tail_refusal
from dataplane.client.vllm.tally import Tally
from dataplane.client.vllm.vllm_stats import KVWardenPromMetrics, KVWardenStats, by_source
from dataplane.client.vllm.wait import OwnSaves, Waits
from dataplane.client.vllm.worker import (
    BlockCopier,
    Loader,
    Registrar,
    Saver,
    allow_amx,
    kv_groups,
    load,
    register_groups,
)
from dataplane.memory.kvmemory import TORCH_DTYPES
from dataplane.wire.messages import KVFormat

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


FLUSH_S = 0.05  # the longest a step with nothing to compute waits for this engine's saves


class KVWardenConnector(KVConnectorBase_V1, SupportsHMA):
    """Supports vLLM's hybrid KV cache manager (``SupportsHMA``): vLLM keeps it on. Each KV cache
    group is a scope of its own, registered by an instance of its own on each worker; a hit
    covers a prefix only when every group can serve it, and a sliding-window group loads only
    its window's chunks (`dataplane.client.vllm.kinds`). A model with sliding windows or several
    groups loads every hit off the step (vLLM takes such a model's failed loads request by
    request, from asynchronous loads only) and finishes its saves within the step (vLLM frees a
    window's old blocks at the next one). A state-space hybrid starts with the cache declined."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise ValueError(
                "kvwarden: pipeline parallel engines are not supported (pipeline_parallel_size 1)"
            )
        kv_role = str(self._kv_transfer_config.kv_role)
        self._cfg = connector_settings(self._kv_transfer_config.kv_connector_extra_config, kv_role)
        self._loads = kv_role != "kv_producer"  # a producer only stores (prefill of a disaggregated pair)
        self._stores = kv_role != "kv_consumer"  # a consumer only loads
        # None, and why: this engine runs without the cache
        scopes, self._declined = cached_scopes(
            describe(vllm_config, kv_cache_config),
            role == KVConnectorRole.SCHEDULER,
            self._cfg["kvwarden.kv_compression"],
        )
        self._scopes = scopes or ()
        self._scope_or_none = scopes[0] if scopes else None
        self._block_size = scopes[0].block_size if scopes else 0
        self._windows = tuple(s.window for s in self._scopes)
        self._group_layers = [list(g.layer_names) for g in kv_cache_config.kv_cache_groups]
        # sliding windows or several groups: loads off the step, failures by request, saves on it
        self._windowed = len(self._scopes) > 1 or any(self._windows)
        if self._windowed and self._cfg["kvwarden.async_load"] is False:
            raise ValueError(
                "kvwarden.async_load false: a model with sliding-window or several KV cache groups "
                "loads its hits off the step (vLLM takes its failed loads only from those); use "
                "true or auto"
            )
        # why this engine cannot move a prompt's tail chunk (`tail.py`), if it cannot
        self._no_tails = tail_refusal(scopes[0].kv_format, self._windowed, self._cfg) if scopes else None
        if self._cfg["kvwarden.store_tail"] and self._no_tails:
            raise ValueError(f"kvwarden.store_tail: {self._no_tails}: its tails would never be loaded")
        if (policy := self._kv_transfer_config.kv_load_failure_policy) != "recompute":
            msg = "kvwarden: kv_load_failure_policy is %r: a load cut short (the server killed while it"
            logger.warning(
                msg + " copies) fails its request; set it to 'recompute' to recompute instead", policy
            )
        self._lookup: ScopeLookup | None = None
        self._planner: Planner | None = None
        self._own: OwnSaves | None = None  # the scheduler's saves on their way (`Planner`'s)
        self._adapter: WorkerAdapter | None = None  # the first KV cache group's instance
        self._more: list[WorkerAdapter] = []  # the other groups' instances, in order
        self._registrars: list[Registrar] = []
        self._saver: Saver | None = None
        self._copier: BlockCopier | None = None  # a prefix still being saved, copied block to block
        self._loader: Loader | None = None  # loads off the step (vLLM's asynchronous loads)
        self._background: set[str] = set()  # requests whose hit vLLM was told to load asynchronously
        self._held: set[str] = set()  # finished requests whose blocks a save or a load still holds
        self._planned: set[str] = set()  # requests this worker was asked to store
        self._load_errors: set[int] = set()
        self._failed_loads: set[str] = set()  # windowed models: loads that came back short
        self._relay: EventRelay | None = None  # kvwarden's events into the engine's own stream
        self._tally = Tally()  # this side's lookups, loads and stores: vLLM's connector stats
        self._token_bytes = [s.token_bytes for s in self._scopes]  # (the loads' and stores' bytes)
        if role == KVConnectorRole.SCHEDULER and scopes:
            self._start_scheduler()

    def _start_scheduler(self) -> None:
        """The scheduler's lookups, planning and KV events relay."""
        cfg = self._cfg
        lookup = ScopeLookup(
            cfg["kvwarden.url"], self._scopes, cfg["kvwarden.lookup_timeout_s"], cfg["kvwarden.retry_s"]
        )
        self._lookup = lookup
        waits = Waits(cfg["kvwarden.lookup_wait_s"], lookup.report_wait)
        own = self._own = OwnSaves(self._scope.world_size)
        self._planner = Planner(lookup.find, self._block_size, waits, own)
        self._planner.windows = self._windows
        self._planner.stores, self._planner.loads = self._stores, self._loads
        self._planner.store_tail, self._planner.load_tail = cfg["kvwarden.store_tail"], not self._no_tails
        self._planner.tally = self._tally
        if self._scope.kv_format is KVFormat.LATENT:
            # a prompt whose one token is left after a hit goes through vLLM's MLA decode
            # path, which on its CPU backend does not compute what a prefill does (the reason
            # vLLM turns its own prefix cache off there): a hit leaves at least two
            self._planner.tail = 2
        self._planner.chunk_size = lambda: lookup.chunk_size
        if cfg["kvwarden.kv_events_endpoint"] is not None:
            self._relay = EventRelay(cfg["kvwarden.kv_events_endpoint"], cfg["kvwarden.kv_events_topic"])
            self._relay.start()

    @property
    def _scope(self) -> Scope:
        assert self._scope_or_none is not None, "a declined engine has no scope"
        return self._scope_or_none

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a store that never happens is a later miss

    # ------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._declined is not None:
            return  # (said once, at start)
        allow_amx()
        groups = kv_groups(kv_caches, TORCH_DTYPES[self._scope.dtype], self._group_layers, len(self._scopes))
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        rank, cfg = get_tensor_model_parallel_rank(), self._cfg
        adapters, self._registrars, kv_format = register_groups(
            self._scopes,
            groups,
            rank,
            cfg["kvwarden.url"],
            cfg["kvwarden.transfer_mode"],
            cfg["kvwarden.connect_wait_s"],
            adapter_options(cfg),
            cfg["kvwarden.retry_s"],
        )
        self._adapter, self._more = adapters[0], adapters[1:]
        self._copier = BlockCopier(groups[0], 1 if kv_format == KVFormat.TOKEN_MAJOR else 0)
        # a format every rank holds alike (the latent) is stored by rank 0 for all of them
        self._saver = Saver(self._adapter, rank == 0 or not kv_format.replicated, self._more)
        self._loader = Loader(self._adapter, self._block_size, self._copier, self._more)
        for t in (self._saver, self._loader):
            t.tally, t.token_bytes = self._tally, self._token_bytes
            t.start()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVWardenConnectorMetadata)
        background = [job for job in meta.plan.loads if job.background]
        if background and self._loader is not None:
            self._loader.submit(background)
        for job in meta.plan.loads:
            if not job.background:
                self._load_errors |= load(
                    self._adapter,
                    job,
                    self._block_size,
                    self._copier,
                    self._more,
                    self._tally,
                    self._token_bytes,
                )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are whole before the forward pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return None  # stores take whole chunks after the forward pass

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVWardenConnectorMetadata)
        if meta.plan.saves and self._saver is not None:
            self._planned |= {s.req_id for s in meta.plan.saves}
            self._saver.submit(meta.plan.saves)
            # a window's old blocks go back at the next step: save them now; a producer's saves
            # are over before its answer leaves, so the consumer it hands off to finds them
            if self._windowed or not self._loads:
                self._saver.drain(self._cfg["kvwarden.request_timeout_s"])
        if meta.plan.flush_saves and self._saver is not None:
            self._saver.drain(FLUSH_S)  # a step with nothing to compute: requests wait for these

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KVWardenConnectorMetadata)
        if kv_connector_metadata.plan.preempted and self._saver is not None:
            self._saver.drain(self._cfg["kvwarden.request_timeout_s"])  # their blocks are reused next

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose saves are over, requests whose background loads are over); the blocks
        a load could not fill go to ``get_block_ids_with_load_errors``, asked next."""
        if self._saver is None or self._loader is None:
            return None, None
        done = self._saver.finished(finished_req_ids, self._planned)
        self._planned -= done
        loaded = set()
        for req_id, missing in self._loader.take_done():
            loaded.add(req_id)
            if missing and self._windowed:
                self._failed_loads.add(req_id)  # (blocks of several groups, or a window: by request)
            else:
                self._load_errors |= missing
        return done or None, loaded or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """`get_finished`'s, and the loads that came back short of a windowed model: vLLM
        recomputes those requests whole (block ids cannot name them: a window's blocks before
        the hit are not loaded, and groups' ids overlap)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed, self._failed_loads = self._failed_loads, set()
        return KVConnectorTransferResults(set(sending or ()), set(recving or ()) | failed, failed)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        saved = self._saver.take_done() if self._saver is not None else []
        return KVWardenWorkerMetadata(saved) if saved else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.stop()
            self._loader.join(self._cfg["kvwarden.request_timeout_s"])
        if self._saver is not None:
            self._saver.stop()
            self._saver.join(self._cfg["kvwarden.request_timeout_s"])
        for registrar in self._registrars:
            registrar.stop()
            registrar.join()
        for adapter in [self._adapter, *self._more]:
            if adapter is not None:
                adapter.close()
        if self._lookup is not None:
            self._lookup.close()
        if self._relay is not None:
            self._relay.stop()
            self._relay.join()

    # ---------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._planner is None:
            return 0, False  # declined (said at start)
        p, rid = self._planner, request.request_id
        key = p.keys[rid] if rid in p.keys else request_key(request, self._block_size)
        if rid not in p.names and not isinstance(key, Uncached):
            p.names[rid] = engine_names(request, self._block_size)
        prompt = prompt_of(request.prompt_token_ids, request.prompt_embeds)
        handed = (
            0 if isinstance(key, Uncached) else expected(getattr(request, "kv_transfer_params", None), key)
        )
        n = p.matched(rid, prompt, num_computed_tokens, key, handed)
        mode = self._cfg["kvwarden.async_load"]
        background = (
            bool(n)
            and not p.copies_own(rid)
            and (mode is True or self._windowed or (mode == "auto" and p.from_lower_tiers(rid)))
        )
        if background:
            self._background.add(rid)
        else:
            self._background.discard(rid)
        return n, background

    def on_new_request(self, request: Request) -> None:
        """A request just given to the scheduler: unless vLLM's own cache may serve all of it,
        the server starts bringing its prefix from the slower tiers into L1 (PREFETCH_SCOPE), so
        the load that follows its LOOKUP finds it there."""
        if (
            self._lookup is None
            or self._planner is None
            or not self._loads
            or not self._cfg["kvwarden.prefetch"]
        ):
            return
        cs = self._lookup.chunk_size
        prompt = prompt_of(request.prompt_token_ids, request.prompt_embeds)
        if cs is None or prompt is None or len(prompt) <= cs:
            return  # (no chunk size learnt yet: the first LOOKUP teaches it)
        key = request_key(request, self._block_size)
        if isinstance(key, Uncached):
            return
        self._planner.keys[request.request_id] = key  # (get_num_new_matched_tokens takes it from here)
        self._lookup.prefetch(np.asarray(prompt[: len(prompt) - 1], dtype=np.int64), key)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KVWardenWorkerMetadata) and self._planner is not None:
            self._planner.own.done(meta.saved)  # those saves landed or failed: not on their way
        if self._planner is not None and connector_output.finished_recving:
            self._planner.loaded(connector_output.finished_recving)
        self._held.difference_update(connector_output.finished_sending or ())
        self._held.difference_update(connector_output.finished_recving or ())

    def has_pending_block_frees(self) -> bool:
        """Blocks of finished requests come back once their saves or loads are over: vLLM may
        wait for them rather than preempt a running request."""
        return bool(self._held)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self._planner is None:
            return  # declined
        rid = request.request_id
        prompt = prompt_of(request.prompt_token_ids, request.prompt_embeds)
        background = rid in self._background and num_external_tokens > 0
        self._background.discard(rid)
        # an asynchronous load is not scheduled this step: the plan loads it into these blocks
        ids = groups_of(blocks.get_block_ids(), self._windows) if background else None
        self._planner.allocated(rid, prompt, num_external_tokens, ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._planner is None:
            return KVWardenConnectorMetadata(Plan())  # declined: nothing to load or store
        so = scheduler_output
        new = [
            (
                r.req_id,
                prompt_of(r.prompt_token_ids, r.prompt_embeds),
                groups_of(r.block_ids, self._windows),
                r.num_computed_tokens,
                so.num_scheduled_tokens[r.req_id],
            )
            for r in so.scheduled_new_reqs
        ]
        c = so.scheduled_cached_reqs
        cached = [
            (
                req_id,
                None if c.new_block_ids[i] is None else groups_of(c.new_block_ids[i], self._windows),  # type: ignore[arg-type]
                req_id in c.resumed_req_ids,
                c.num_computed_tokens[i],
                so.num_scheduled_tokens[req_id],
            )
            for i, req_id in enumerate(c.req_ids)
        ]
        plan = self._planner.plan(new, cached, bool(so.preempted_req_ids), so.preempted_req_ids)
        if so.total_num_scheduled_tokens == 0 and len(self._planner.waits):
            if len(self._planner.own):
                plan.flush_saves = True  # the worker finishes this engine's saves (`Plan`)
            elif (idle := self._planner.waits.idle_s()) > 0:
                time.sleep(idle)  # waiting for another engine's stores: do not spin (`Waits.idle_s`)
        return KVWardenConnectorMetadata(plan)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return () if self._relay is None else self._relay.take()

    # ----------------------------------------------------------------- stats
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This side's lookups (scheduler), loads and stores (worker) since vLLM last asked."""
        data = self._tally.take()
        return None if data is None else KVWardenStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVWardenStats(data=data) if data is not None else KVWardenStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KVWardenPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        """Where a hit's tokens come from, as the server told when asked (`Planner.hit_sources`):
        the engine's own blocks (``device``), the server's L1 (``host``), its file tier
        (``disk``), Redis (``external_unspecified``: vLLM has no remote source of its own)."""
        if self._planner is None or num_external_tokens <= 0:
            return {}
        split = self._planner.hit_sources(
            request.request_id, request.num_computed_tokens, num_external_tokens
        )
        return by_source(split)

    def reset_cache(self) -> bool | None:
        """vLLM's reset of the external cache (``reset_prefix_cache(reset_connector=True)``, after
        a weight update): every chunk of this engine's scopes leaves every tier (CLEAR_SCOPE),
        and no save on its way is copied from or waited for. True only when the server removed
        all of it and no save is under way (its chunks could land after: vLLM's own reset fails
        then too, while their blocks are held, and is retried)."""
        if self._lookup is None or self._own is None:
            return True  # declined: this engine's KV was never cached
        cleared = self._lookup.clear()
        self._own.forget()
        if self._held:
            msg = "kvwarden: cache reset with %d request(s) still saving: their chunks may land after it"
            logger.warning(msg + "; reset again once they are done", len(self._held))
        return cleared and not self._held

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._planner is None:
            return False, None  # declined
        rid = request.request_id
        self._background.discard(rid)
        params = None
        if not self._loads and (stored := self._planner.stored(rid)):  # a producer hands off
            key = self._planner.keys.get(rid)
            params = produced(stored, None if isinstance(key, Uncached) else key, self._cfg["kvwarden.url"])
        held = self._planner.finished(rid)
        if held:
            self._held.add(rid)
        return held, params

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid manager asks this instead: every group's blocks are held alike."""
        if self._planner is None:
            return False, None  # declined
        return self.request_finished(request, block_ids[0])
