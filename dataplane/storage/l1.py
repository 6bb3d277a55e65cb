"""L1: a byte-bounded local CPU chunk store with LRU eviction.

Writes are two-phase: ``reserve`` hands out a buffer (evicting least-recently-used chunks that
no reader holds), the caller copies into it outside any lock, then ``commit`` publishes it (or
``abort`` returns it). Readers ``acquire`` a prefix of chunks, which pins them against eviction,
copy out, then ``release``. Evicted buffers of the same size are recycled: a fresh allocation
costs a page fault per 4 KiB on its first write, which halves copy throughput.

Accounting is exact: ``used_bytes`` is committed plus reserved chunk bytes; recycled buffers
waiting for reuse are ``pooled_bytes``; ``used + pooled <= capacity`` always holds.
On CUDA hosts buffers are pinned so device copies run at full speed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch


@dataclass
class _Entry:
    buf: torch.Tensor
    readers: int = 0


@dataclass
class L1Stats:
    used_bytes: int
    capacity_bytes: int
    pooled_bytes: int
    chunks: int
    hot_cache: bool
    evictions: int
    rejected: int


@dataclass
class L1Store:
    capacity_bytes: int
    hot_cache: bool = True
    pin_memory: bool = False
    # _lock guards every field below it; it is a leaf lock: no copy or allocation runs under it
    # except the (cheap, lazy) torch.empty of a new buffer.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _entries: OrderedDict[bytes, _Entry] = field(default_factory=OrderedDict, repr=False)
    _pool: dict[int, list[torch.Tensor]] = field(default_factory=dict, repr=False)
    _used: int = 0
    _pooled: int = 0
    _pinned: int = 0  # bytes of chunks some reader holds
    _evictions: int = 0
    _rejected: int = 0

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError("L1 capacity must be > 0")

    # ---------------------------------------------------------------- reads
    def prefix_hits(self, keys: list[bytes]) -> int:
        """How many leading keys are present (refreshes their LRU position)."""
        n = 0
        with self._lock:
            for k in keys:
                if k not in self._entries:
                    break
                self._entries.move_to_end(k)
                n += 1
        return n

    def acquire_prefix(self, keys: list[bytes]) -> list[torch.Tensor]:
        """Pin and return the buffers of the longest present prefix of ``keys``."""
        out: list[torch.Tensor] = []
        with self._lock:
            for k in keys:
                e = self._entries.get(k)
                if e is None:
                    break
                self._pin(e)
                self._entries.move_to_end(k)
                out.append(e.buf)
        return out

    def release(self, keys: list[bytes]) -> None:
        with self._lock:
            for k in keys:
                e = self._entries.get(k)
                if e is not None and e.readers > 0:
                    e.readers -= 1
                    if e.readers == 0:
                        self._pinned -= e.buf.numel()

    def pin_present(self, keys: list[bytes]) -> tuple[list[int], list[bytes]]:
        """Pin every present key (a writer protects a prompt's own chunks from its later
        reserves); returns (indices missing, keys pinned) — ``release`` the latter."""
        missing: list[int] = []
        pinned: list[bytes] = []
        with self._lock:
            for i, k in enumerate(keys):
                e = self._entries.get(k)
                if e is None:
                    missing.append(i)
                    continue
                self._pin(e)
                self._entries.move_to_end(k)
                pinned.append(k)
        return missing, pinned

    # --------------------------------------------------------------- writes
    def reserve(self, nbytes: int) -> torch.Tensor | None:
        """A buffer of ``nbytes`` counted as used, or None when L1 cannot take it now."""
        with self._lock:
            if nbytes > self.capacity_bytes - self._pinned:
                self._rejected += 1  # could never fit: evict nothing
                return None
            pooled = self._pool.get(nbytes)
            if pooled:
                buf = pooled.pop()
                self._pooled -= nbytes
                self._used += nbytes
                return buf
            while self._used + self._pooled + nbytes > self.capacity_bytes:
                if self._drop_other_pooled(nbytes):
                    continue
                victim = self._evict_one()
                if victim is None:
                    self._rejected += 1
                    return None
                if victim.numel() == nbytes:  # reuse the evicted buffer directly
                    self._used += nbytes
                    return victim
                self._pool.setdefault(victim.numel(), []).append(victim)
                self._pooled += victim.numel()
            self._used += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)

    def commit(self, key: bytes, buf: torch.Tensor, pin: bool = False) -> bool:
        """Publish a reserved buffer; False (buffer recycled) when the key was already present.
        With ``pin`` the chunk stays pinned (whichever copy won) until ``release``."""
        with self._lock:
            e = self._entries.get(key)
            written = e is None
            if e is None:
                e = self._entries[key] = _Entry(buf)
            else:
                self._recycle(buf)
            if pin:
                self._pin(e)
            return written

    def abort(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._recycle(buf)

    def clear(self) -> int:
        """Drop every chunk no reader holds; returns how many were dropped."""
        with self._lock:
            victims = [k for k, e in self._entries.items() if e.readers == 0]
            for k in victims:
                self._used -= self._entries.pop(k).buf.numel()
            self._pool.clear()
            self._pooled = 0
            return len(victims)

    def set_hot_cache(self, on: bool) -> None:
        with self._lock:
            self.hot_cache = on

    def stats(self) -> L1Stats:
        with self._lock:
            return L1Stats(
                self._used,
                self.capacity_bytes,
                self._pooled,
                len(self._entries),
                self.hot_cache,
                self._evictions,
                self._rejected,
            )

    # ------------------------------------------------------- lock held below
    def _pin(self, e: _Entry) -> None:
        if e.readers == 0:
            self._pinned += e.buf.numel()
        e.readers += 1

    def _recycle(self, buf: torch.Tensor) -> None:
        n = buf.numel()
        self._used -= n
        self._pool.setdefault(n, []).append(buf)
        self._pooled += n

    def _drop_other_pooled(self, keep_size: int) -> bool:
        for size, bufs in self._pool.items():
            if size != keep_size and bufs:
                bufs.pop()
                self._pooled -= size
                return True
        return False

    def _evict_one(self) -> torch.Tensor | None:
        for k, e in self._entries.items():  # oldest first
            if e.readers == 0:
                del self._entries[k]
                self._used -= e.buf.numel()
                self._evictions += 1
                return e.buf
        return None
