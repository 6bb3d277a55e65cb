"""The storage tiers, each a folder with its own door, and what they share.

- `l1/`: the local CPU tier (its arena, tenants, stores in flight); door: `L1Store`.
- `fs/`: the file tier (chunk files under ``fs_path``); door: `FileTier`.
- `remote/`: the Redis tier shared by many servers; door: `RemoteBackend`.
- `tiered`: `TieredStore`, L1 then the file tier then the remote tier, behind the health gate:
  the one module that sees all three.
- Shared below them: `keys` (chunk keys), `codec` (the checked value format the file and remote
  tiers store), `lower` (what the two lower tiers report alike: ping codes, drop reasons,
  duration buckets, out-of-space episodes), `evict` (eviction orders).

The tiers never import each other (import-linter keeps it so); nothing here imports the server,
the modules or the client.
"""
