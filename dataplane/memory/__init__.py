"""Memory both sides share: POSIX shared-memory segments and a worker's paged KV layout.

`shm` creates, attaches, unlinks and sweeps `/dev/shm` segments (each owned through a `flock`
held for the owner's lifetime); `kvmemory` maps a registered KV layout and holds the chunk copy
kernels, including the `CopySplitter` whose ``kvwarden-copy`` threads split big copies by layer.
No locks live here beyond the splitter's pool.
"""
