"""The L1 arena: one region of ``capacity`` bytes, reserved at start and carved into chunk buffers.

A chunk buffer from fresh memory pays a page fault per page on its first write, which made the
first gigabytes a new server stores several times slower than the rest. The arena is therefore
one mapping made at start, faulted in by a background thread (``kvwarden-arena``) while the
server already answers, with ``MADV_POPULATE_WRITE`` (it maps pages writable without changing
their bytes, so it may run under live copies; a kernel without it falls back to faulting on
first use).

Backing: a segment in the segment directory owned by the server (mode 0600), its space reserved
slice by slice with ``posix_fallocate`` ahead of use, so a full tmpfs can never fault a copy;
only the reserved prefix is handed out, and it grows as the thread goes. Where the directory has
no room for the whole arena (a container's 64 MiB ``/dev/shm``), private anonymous memory,
advised for transparent huge pages. On CUDA hosts the region is registered as pinned memory once.

The allocator (`Extents`) is first-fit over free extents kept sorted by offset, coalescing on
free; sizes are rounded up to 64 bytes. It has no lock of its own: `dataplane.storage.l1.store.L1Store`
calls it under its lock. ``_lock`` here guards the growth watermark and the fault-in progress.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dataplane.memory.shm import SHM_DIR, Segment

logger = logging.getLogger(__name__)

ALIGN = 64  # chunk buffers start on a cache line; the region itself is whole pages
PAGE = 4096
# faulted (and reserved) per step: each populate holds the address-space lock for its slice, and
# a thread that maps memory meanwhile (a new mapping, a thread's stack) waits for it
_SLICE = 16 << 20
_MADV_POPULATE_WRITE = 23  # Linux 5.14
_libc = ctypes.CDLL(None, use_errno=True)


def _round_up(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


class Extents:
    """First-fit allocation of byte ranges, coalescing neighbours on free (caller locks)."""

    def __init__(self, size: int = 0) -> None:
        self._offsets: list[int] = []  # free extents, sorted by offset
        self._sizes: dict[int, int] = {}
        self.free_bytes = 0
        if size:
            self.free(0, size)

    def alloc(self, n: int) -> int | None:
        n = _round_up(n)
        for off in self._offsets:
            size = self._sizes[off]
            if size >= n:
                self._remove(off)
                if size > n:
                    self._insert(off + n, size - n)
                self.free_bytes -= n
                return off
        return None

    def free(self, off: int, n: int) -> None:
        n = _round_up(n)
        self.free_bytes += n
        nxt = off + n
        if nxt in self._sizes:  # merge the next extent into this one
            n += self._sizes[nxt]
            self._remove(nxt)
        i = bisect.bisect_left(self._offsets, off)
        if i > 0:
            prev = self._offsets[i - 1]
            if prev + self._sizes[prev] == off:  # merge this one into the previous extent
                self._sizes[prev] += n
                return
        self._insert(off, n)

    def largest(self) -> int:
        return max(self._sizes.values(), default=0)

    def fragmentation(self) -> float:
        """1 - largest free extent / free bytes: 0 when the free space is one piece."""
        return 0.0 if not self.free_bytes else 1.0 - self.largest() / self.free_bytes

    def _insert(self, off: int, n: int) -> None:
        bisect.insort(self._offsets, off)
        self._sizes[off] = n

    def _remove(self, off: int) -> None:
        self._offsets.pop(bisect.bisect_left(self._offsets, off))
        del self._sizes[off]


@dataclass(frozen=True)
class ArenaStats:
    capacity_bytes: int
    backing: str  # "shm" (shareable with workers) or "private"
    faulted_bytes: int  # faulted in by the background thread so far
    ready: bool  # the whole arena is faulted in (and, for shm, reserved)
    huge_page_bytes: int  # the process's AnonHugePages (the arena's, when private)


class Arena:
    def __init__(
        self, capacity: int, *, shared: bool | None = None, pin_memory: bool = False, prefault: bool = True
    ) -> None:
        """``shared`` None: shared when the segment directory has room for it; True: shared, or
        OSError (ENOSPC) naming the directory when it has no room; False: private."""
        self.capacity = _round_up(capacity, PAGE)
        room = _room_in(SHM_DIR)
        if shared is None:
            shared = room >= self.capacity + (64 << 20)
        elif shared and room < self.capacity:
            raise OSError(
                errno.ENOSPC,
                f"l1_backing shm: {SHM_DIR} has {room} bytes free, and an L1 of {self.capacity} bytes "
                "does not fit; make room there or use l1_backing auto or private",
            )
        self.segment: Segment | None = None
        if shared:
            self.segment = Segment.create(self.capacity, reserve=False)
            self._mm = self.segment.mm
        else:
            self._mm = mmap.mmap(-1, self.capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                self._mm.madvise(mmap.MADV_HUGEPAGE)
        self.region = torch.frombuffer(memoryview(self._mm), dtype=torch.uint8)
        self._addr = self.region.data_ptr()
        if pin_memory and torch.cuda.is_available():
            torch.cuda.cudart().cudaHostRegister(self._addr, self.capacity, 0)  # type: ignore[no-untyped-call]
        self._lock = threading.Lock()  # guards _usable, _faulted, _grown, _huge and _caught_up
        # bytes that may be handed out: shm space is reserved ahead of use; private is all usable
        self._usable = 0 if shared else self.capacity
        self._grown = not shared  # no more will become usable (all of it, or reserving failed)
        self._huge = 0  # bytes in huge pages, read once the fault-in ends (reading is not free)
        self._populated = True  # False where the kernel cannot populate: pages fault on use
        self._faulted = 0
        self._grew = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._prefault = prefault
        self._closed = False
        # set by L1: whether the fault-in should step aside now (transfers are copying and the
        # usable part still has room for them): a 2-core host has no core to spare for both
        self.yield_to: Callable[[int], bool] | None = None
        # set by L1: whether the arena should grow now, given how much of it is in use (it grows
        # ahead of use, not to its capacity at once: a fresh server's first requests would pay
        # for gigabytes of pages no chunk needs yet). None: grow to the capacity
        self.needed: Callable[[int], bool] | None = None
        self._nudge = threading.Event()  # set when growth may be needed again (`nudge`)
        self._faulting = prefault  # the fault-in has not ended (a hint, read without a lock)
        self._caught_up = False  # the thread waits until more is needed (under _lock)
        if not prefault and shared:
            self._reserve_all()

    @property
    def backing(self) -> str:
        return "shm" if self.segment is not None else "private"

    def view(self, off: int, n: int) -> torch.Tensor:
        return self.region[off : off + n]

    def offset_of(self, buf: torch.Tensor) -> int:
        return buf.data_ptr() - self._addr

    def growth(self) -> tuple[int, bool]:
        """(bytes that may be handed out, whether that is final)."""
        with self._lock:
            return self._usable, self._grown

    def wait_usable(self, above: int, timeout_s: float) -> bool:
        """Wait until more than ``above`` bytes are usable (the fault-in thread is still
        reserving); False when no more will be, or the time ran out."""
        with self._grew:
            if self._usable <= above and not self._grown:
                self._grew.wait(timeout_s)
            return self._usable > above

    # ------------------------------------------------------------------ thread
    def start(self) -> None:
        if self._prefault and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvwarden-arena", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._nudge.set()

    def nudge(self) -> None:
        """More of the arena may be needed now: a fault-in waiting for that looks again (once it
        has ended, nothing is done: a reserve calls this for every chunk)."""
        if self._faulting:
            self._nudge.set()

    def join(self, timeout_s: float = 10.0) -> bool:
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._fault_in()
        finally:
            self._faulting = False
            huge = _huge_page_bytes() if self.segment is None else 0  # shmem here gets none
            with self._grew:
                self._grown = True
                self._huge = huge
                self._grew.notify_all()

    def _fault_in(self) -> None:
        t0 = time.monotonic()
        populate = True
        for off in range(0, self.capacity, _SLICE):
            self._wait_until_needed(off)
            while self.yield_to is not None and self.yield_to(off) and not self._stop.is_set():
                self._stop.wait(0.002)
            if self._stop.is_set():
                return
            n = min(_SLICE, self.capacity - off)
            try:
                if self.segment is not None:
                    os.posix_fallocate(self.segment.lock_fd, off, n)  # releases the GIL
            except OSError as exc:
                logger.error(
                    "arena: cannot reserve %d more bytes of L1 in %s: %s; L1 stays at %d bytes",
                    n,
                    SHM_DIR,
                    exc.strerror,
                    off,
                )
                return
            if populate:
                populate = _populate(self._addr + off, n)
                self._populated = populate
            with self._grew:
                self._usable = max(self._usable, off + n)
                self._faulted = off + n if populate else self._faulted
                self._grew.notify_all()
        logger.info(
            "arena: %d bytes of L1 (%s) ready in %.1fs", self.capacity, self.backing, time.monotonic() - t0
        )

    def _wait_until_needed(self, off: int) -> None:
        """Wait (for a `nudge`, or a second at most, then ask again) while L1 has enough of the
        arena ready ahead of what it holds."""
        while self.needed is not None and not self._stop.is_set():
            self._nudge.clear()
            if self.needed(off):
                break
            with self._lock:
                self._caught_up = True
            self._nudge.wait(1.0)
        with self._lock:
            self._caught_up = False

    def _reserve_all(self) -> None:
        assert self.segment is not None
        os.posix_fallocate(self.segment.lock_fd, 0, self.capacity)
        self._usable = self.capacity
        self._grown = True

    def stats(self) -> ArenaStats:
        with self._lock:
            usable, faulted, grown, huge = self._usable, self._faulted, self._grown, self._huge
            caught_up = self._caught_up
        faulted_all = faulted >= self.capacity or not self._prefault or not self._populated
        ready = (grown and usable >= self.capacity and faulted_all) or caught_up
        return ArenaStats(self.capacity, self.backing, faulted, ready, huge)

    def close(self) -> None:
        """Drop the mapping (and unlink the segment); callers hold no views any more. Idempotent."""
        self.stop()
        self.join()
        if self._closed:
            return
        self._closed = True
        del self.region
        if self.segment is not None:
            self.segment.unlink()
            self.segment.close()
        else:
            with contextlib.suppress(BufferError):  # a view still lives: the mapping goes with it
                self._mm.close()


def _populate(addr: int, n: int) -> bool:
    """Map [addr, addr+n) writable now; False when the kernel cannot (then first use faults)."""
    r = _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(n), _MADV_POPULATE_WRITE)
    if r != 0:
        logger.info(
            "arena: MADV_POPULATE_WRITE unavailable (errno %d): pages fault on first use", ctypes.get_errno()
        )
        return False
    return True


def _room_in(directory: os.PathLike[str] | str) -> int:
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _huge_page_bytes() -> int:
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
