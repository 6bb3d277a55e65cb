"""POSIX shared-memory segments for KV caches, without Python's resource_tracker.

``multiprocessing.shared_memory`` registers every segment it creates *or attaches* with the
resource tracker, which unlinks it when that process exits: the server attaching to a worker's
segment would destroy it. We use ``/dev/shm`` files directly instead.

Ownership: the creating process (the worker) holds a shared ``flock`` on the segment file for as
long as it lives; the kernel drops it when the process dies, however it dies, and whichever pid
namespace it ran in. The owner unlinks the segment on close and at exit. A worker that dies
without closing leaves it behind; whoever notices the owner is gone (an exclusive non-blocking
``flock`` succeeds) unlinks it: the server when it reaps or unregisters the instance, and every
server start sweeps ``/dev/shm`` for such segments. An owner that is still alive keeps its
segment, so a restarted server can map it again when the worker re-registers. A segment is
created under a temporary name, locked, then renamed, so a sweep never sees it unlocked.
The name (``kvwarden-<pid>-<random>``) carries the creator's pid for operators only.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SHM_DIR = Path(os.environ.get("KVWARDEN_SHM_DIR", "/dev/shm"))
PREFIX = "kvwarden-"
_NAME_RE = re.compile(r"^kvwarden-(\d+)-([0-9a-f]{16})$")


def owner_alive(name: str) -> bool:
    """Whether the process that created segment ``name`` still runs (it holds the flock).

    Anything that is not a regular file we can open (a directory, a FIFO, another user's
    segment) counts as alive: it is not ours to remove."""
    try:
        fd = os.open(SHM_DIR / name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return True
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # BlockingIOError: the owner holds it
        return True
    finally:
        os.close(fd)  # closing drops our probe lock, if we got it
    return False


def valid_segment_name(name: str) -> bool:
    return _NAME_RE.match(name) is not None


@dataclass
class Segment:
    """One mapped segment: ``mm`` stays open while any tensor views it."""

    name: str
    size: int
    mm: mmap.mmap
    owner: bool
    lock_fd: int = -1  # the owner's flock, held until close

    @classmethod
    def create(cls, size: int) -> Segment:
        token = secrets.token_hex(8)
        name = f"{PREFIX}{os.getpid()}-{token}"
        tmp = SHM_DIR / f".kvwarden-creating-{token}"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            os.rename(tmp, SHM_DIR / name)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return cls(name, size, mm, owner=True, lock_fd=fd)

    @classmethod
    def attach(cls, name: str, min_size: int) -> Segment:
        """Map an existing segment; MAP_POPULATE pre-faults it so the first copy is not slow."""
        if not valid_segment_name(name):
            raise ValueError(f"segment name {name!r} is not a kvwarden segment")
        fd = os.open(SHM_DIR / name, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < min_size:
                raise ValueError(f"segment {name} holds {size} bytes, the layout needs {min_size}")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        return cls(name, size, mm, owner=False)

    def as_tensor(self) -> torch.Tensor:
        """The whole segment as a uint8 tensor. Through a memoryview, so the mapping stays
        exported (``close`` refuses) while any view of it lives; ``torch.frombuffer`` on the
        mmap itself would let ``close`` unmap memory a tensor still points at."""
        return torch.frombuffer(memoryview(self.mm), dtype=torch.uint8)

    def close(self) -> bool:
        """Unmap; False when a view still holds the buffer (it is unmapped when that view dies)."""
        try:
            self.mm.close()
        except BufferError:
            return False
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1
        return True

    def unlink(self) -> None:
        """Remove the name. The owner's lock guards nothing once the name is gone: it is let go
        here, not at ``close`` (a caller may unlink while tensors still view the mapping)."""
        unlink_segment(self.name)
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1


def unlink_segment(name: str) -> bool:
    try:
        os.unlink(SHM_DIR / name)
    except OSError as exc:
        if not isinstance(exc, FileNotFoundError):
            logger.warning("shm: cannot unlink %s: %s", name, exc)
        return False
    return True


def unlink_if_owner_gone(name: str) -> bool:
    if not valid_segment_name(name) or owner_alive(name):
        return False
    removed = unlink_segment(name)
    if removed:
        logger.info("shm: unlinked segment %s: its owner has exited", name)
    return removed


def sweep_orphans() -> list[str]:
    """Unlink every kvwarden segment whose owner process is gone; returns their names."""
    removed: list[str] = []
    try:
        entries = list(SHM_DIR.iterdir())
    except FileNotFoundError:
        return removed
    for path in entries:
        if path.name.startswith(PREFIX) and unlink_if_owner_gone(path.name):
            removed.append(path.name)
    if removed:
        logger.warning("shm: swept %d orphaned segment(s) at start", len(removed))
    return removed
