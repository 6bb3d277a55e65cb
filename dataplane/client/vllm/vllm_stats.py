"""kvwarden's figures in vLLM's own ``/metrics``, through its connector stats API: the scheduler's
and every worker's `tally.Tally` travel as `KVWardenStats` (a plain dict: it crosses process
boundaries), are summed, and `KVWardenPromMetrics` records them per engine:

- ``vllm:kvwarden_lookups_total{outcome}``: requests by what the lookup found (``hit``,
  ``miss``, ``unanswered``: the server could not be asked, the request recomputes);
- ``vllm:kvwarden_loads_total{outcome}``: loads that brought all they planned (``full``) or were
  cut short (``short``: the rest recomputed), and ``vllm:kvwarden_load_seconds``, each load's
  time;
- ``vllm:kvwarden_loaded_tokens_total``, ``vllm:kvwarden_loaded_bytes_total``;
- ``vllm:kvwarden_stored_chunks_total``, ``vllm:kvwarden_stored_bytes_total``,
  ``vllm:kvwarden_failed_stores_total``.

Where each hit's tokens came from is vLLM's own ``vllm:prompt_tokens_cached_by_source``
(the connector's ``get_external_cache_hit_sources``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from dataplane.client.vllm.tally import COUNTERS

# where a hit's tokens come from (`Planner.hit_sources`), as vLLM names its sources
SOURCES = {
    "device": CacheHitSource.DEVICE,
    "host": CacheHitSource.HOST,
    "disk": CacheHitSource.DISK,
    "remote": CacheHitSource.EXTERNAL_UNSPECIFIED,
}
LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# counter -> (metric, its outcome label or None)
_METRIC = {
    "lookups_hit": ("lookups", "hit"),
    "lookups_miss": ("lookups", "miss"),
    "lookups_unanswered": ("lookups", "unanswered"),
    "loads_full": ("loads", "full"),
    "loads_short": ("loads", "short"),
    **{c: (c, None) for c in COUNTERS if not c.startswith(("lookups_", "loads_"))},
}
_HELP = {
    "lookups": "Requests the kvwarden connector looked up, by outcome (hit, miss, unanswered).",
    "loads": "Loads from kvwarden, by outcome (full; short: cut short, the rest recomputed).",
    "loaded_tokens": "Tokens loaded from kvwarden.",
    "loaded_bytes": "KV bytes loaded from kvwarden.",
    "stored_chunks": "Chunks stored to kvwarden (not those it held already).",
    "stored_bytes": "KV bytes stored to kvwarden.",
    "failed_stores": "Stores to kvwarden that failed (the server down or refusing).",
}


def by_source(split: dict[str, int]) -> dict[CacheHitSource, int]:
    """`Planner.hit_sources`'s split, as vLLM names its sources."""
    return {SOURCES[k]: n for k, n in split.items()}


@dataclass
class KVWardenStats(KVConnectorStats):
    """``data``: ``{"counts": {counter: n}, "load_s": [seconds of each load]}``."""

    def __post_init__(self) -> None:
        if "counts" not in self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, Any] = {"counts": {}, "load_s": []}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        counts: dict[str, int] = self.data["counts"]
        for name, n in other.data.get("counts", {}).items():
            counts[name] = counts.get(name, 0) + n
        times: list[float] = self.data["load_s"]
        times.extend(other.data.get("load_s", ()))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data["counts"])
        times = sorted(self.data["load_s"])
        if times:
            out["load_s_median"] = times[len(times) // 2]
            out["load_s_max"] = times[-1]
        return out

    def is_empty(self) -> bool:
        return not self.data["counts"] and not self.data["load_s"]


class KVWardenPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, Any] = {}
        for metric, doc in _HELP.items():
            labels = [*labelnames, "outcome"] if metric in ("lookups", "loads") else labelnames
            self._counters[metric] = self._counter_cls(
                name=f"vllm:kvwarden_{metric}", documentation=doc, labelnames=labels
            )
        self._load_s = self._histogram_cls(
            name="vllm:kvwarden_load_seconds",
            documentation="Time of each load from kvwarden (a request's prefix into its blocks).",
            buckets=list(LOAD_BUCKETS),
            labelnames=labelnames,
        )
        for values in per_engine_labelvalues.values():  # every series from the start: 0, not absent
            for metric, outcome in _METRIC.values():
                self._child(metric, values, outcome)
            self._load_s.labels(*values)

    def _child(self, metric: str, values: list[object], outcome: str | None) -> Any:
        c = self._counters[metric]
        return c.labels(*values, outcome) if outcome is not None else c.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        values = self.per_engine_labelvalues[engine_idx]
        for counter, n in transfer_stats_data.get("counts", {}).items():
            if counter in _METRIC and n:
                metric, outcome = _METRIC[counter]
                self._child(metric, values, outcome).inc(n)
        hist = self._load_s.labels(*values)
        for s in transfer_stats_data.get("load_s", ()):
            hist.observe(s)
