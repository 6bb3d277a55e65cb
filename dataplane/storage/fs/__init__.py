"""The file tier: chunks in files under ``fs_path``, between L1 and the remote tier.

Door: `FileTier` (`tier`), its snapshot `FsStats` (`stats`). Inside: `layout` (where a chunk's
file lives, the scan), `chunk_file` (one file read checked, written whole, removed), `resident`
(reads in place from the page cache, and reads followed as they land), `reads` (the tier's read
side), `index` (what is on disk, in eviction order), `disk` (disk calls with a deadline, on the
tier's I/O threads), `stats` (its counters).

It may import `dataplane.events` and, of storage, only `codec`, `lower` and `evict`: never the
wire (`dataplane.wire`), L1 or the remote tier (import-linter keeps it so).
"""

from __future__ import annotations

from dataplane.storage.fs.stats import FsStats
from dataplane.storage.fs.tier import FileTier

__all__ = ["FileTier", "FsStats"]
