"""The worker side: ``allocate_kv_caches`` and ``WorkerAdapter``.

`adapter` is the adapter an engine worker holds; `heartbeat` its liveness signal and recovery
(thread ``kvwarden-heartbeat``); `channel` one DEALER socket with its request lock;
`transport` one way of moving KV bytes per transfer mode; `kvalloc` the shared-memory KV
caches the server can map. Nothing here imports the server side: only `dataplane.wire` and
`dataplane.memory`.
"""

from __future__ import annotations

from dataplane.client.adapter import WorkerAdapter
from dataplane.client.kvalloc import allocate_kv_caches, free_kv_caches

__all__ = ["WorkerAdapter", "allocate_kv_caches", "free_kv_caches"]
