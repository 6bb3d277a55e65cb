"""L1, the local CPU tier: chunk buffers in one arena reserved at start, byte-bounded, evicted
by `evict`'s orders, shared fairly among tenants.

Door: `L1Store` (`store`), its snapshot `L1Stats` and what a clear removed, `ScopeCleared`
(`stats`). Inside: `arena` (the region
and its first-fit allocator), `tenants` (each tenant's bytes, hits, evictions and share),
`inflight` (stores being written now, which a LOOKUP counts as pending).

It may import `dataplane.memory`, `dataplane.events`, `dataplane.wire`'s key context and, of
storage, `evict`: never the file or the remote tier (import-linter keeps it so).
"""

from __future__ import annotations

from dataplane.storage.l1.stats import L1Stats, ScopeCleared
from dataplane.storage.l1.store import L1Store

__all__ = ["L1Stats", "L1Store", "ScopeCleared"]
