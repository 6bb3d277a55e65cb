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
created under a temporary name, locked, then renamed, so a sweep never sees it unlocked; a
temporary file whose creator died before the rename is swept once it is unlocked and a few
seconds old. The name (``kvwarden-<pid>-<random>``) carries the creator's pid for operators only.

Space: ``create`` reserves every byte with ``posix_fallocate``, so a segment directory without
room refuses at create (ENOSPC) instead of the first write of a page it cannot back raising
SIGBUS. ``attach`` maps only what a REGISTER may name: a regular file (never through a symbolic
link), owned by this process's effective uid, fully allocated (not sparse).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SHM_DIR = Path(os.environ.get("KVWARDEN_SHM_DIR", "/dev/shm"))
PREFIX = "kvwarden-"
_NAME_RE = re.compile(r"^kvwarden-(\d+)-([0-9a-f]{16})$")
CREATING_PREFIX = ".kvwarden-creating-"
_CREATING_RE = re.compile(r"^\.kvwarden-creating-[0-9a-f]{16}$")
# A temporary file younger than this may belong to a live creator between its O_CREAT and its
# flock: the sweep leaves it alone even when it is unlocked.
CREATING_GRACE_S = 10.0
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def owner_alive(name: str) -> bool:
    """Whether the process that created segment ``name`` still runs (it holds the flock).

    Anything that is not a regular file we can open (a directory, a FIFO, another user's
    segment) counts as alive: it is not ours to remove."""
    try:
        fd = os.open(SHM_DIR / name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY)
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
    def create(cls, size: int, reserve: bool = True) -> Segment:
        """A new segment of ``size`` bytes, every one reserved; OSError (ENOSPC when the segment
        directory has no room) names the directory and the size. ``reserve`` False: sized but
        neither reserved nor pre-faulted (the owner reserves it with ``posix_fallocate`` on
        ``lock_fd`` before any byte of it is used: the L1 arena does, slice by slice)."""
        if size <= 0:
            raise ValueError(f"a segment needs a positive size, got {size}")
        token = secrets.token_hex(8)
        name = f"{PREFIX}{os.getpid()}-{token}"
        tmp = SHM_DIR / f"{CREATING_PREFIX}{token}"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if reserve:
                _reserve(fd, size)
            else:
                os.ftruncate(fd, size)
            populate = getattr(mmap, "MAP_POPULATE", 0) if reserve else 0
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate)
            os.rename(tmp, SHM_DIR / name)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return cls(name, size, mm, owner=True, lock_fd=fd)

    @classmethod
    def attach(cls, name: str, min_size: int, allow_sparse: bool = False) -> Segment:
        """Map an existing segment; MAP_POPULATE pre-faults it so the first copy is not slow.

        ValueError, naming the segment and the reason, for anything that is not a fully
        allocated regular file of this process's effective uid of at least ``min_size`` bytes;
        FileNotFoundError when it does not exist; another OSError when it cannot be opened."""
        if not valid_segment_name(name):
            raise ValueError(f"segment name {name!r} is not a kvwarden segment")
        fd, st = _open_regular(name)
        try:
            size = st.st_size
            if size < min_size:
                raise ValueError(f"segment {name} holds {size} bytes, the layout needs {min_size}")
            allocated = st.st_blocks * 512
            if allocated < size and not allow_sparse:  # (a worker maps the server's L1 arena,
                # which reserves its space as it grows and hands out only what it reserved)
                raise ValueError(
                    f"segment {name} is sparse: {allocated} of {size} bytes allocated; "
                    "create it with posix_fallocate"
                )
            # a sparse segment is not pre-faulted: populating its holes would allocate them
            populate = 0 if allow_sparse else getattr(mmap, "MAP_POPULATE", 0)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate)
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


def _reserve(fd: int, size: int) -> None:
    """Allocate every byte of the file now (it also sets the size): a directory without room
    refuses here, not with SIGBUS at the first write of a page the filesystem cannot back."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        reason = exc.strerror or os.strerror(exc.errno or 0)
        raise OSError(exc.errno, f"{reason}: cannot reserve {size} bytes in {SHM_DIR}") from None


def _kind(mode: int) -> str:
    return next((what for test, what in _FILE_KINDS if test(mode)), f"file type {stat.S_IFMT(mode):o}")


def _require_regular(name: str, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"segment {name} is a symbolic link")
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"segment {name} is not a regular file (it is {_kind(st.st_mode)})")


def _open_regular(name: str) -> tuple[int, os.stat_result]:
    """Open segment ``name`` read-write, refusing (ValueError) a symbolic link, anything but a
    regular file, a file swapped between the look and the open, and another uid's file."""
    path = SHM_DIR / name
    before = os.lstat(path)
    _require_regular(name, before)
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # swapped for a link after the lstat
            raise ValueError(f"segment {name} is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        _require_regular(name, st)
        if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            raise ValueError(f"segment {name} was replaced while it was being opened")
        euid = os.geteuid()
        if st.st_uid != euid:
            raise ValueError(f"segment {name} is owned by uid {st.st_uid}, not uid {euid}")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


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


def unlink_if_creator_gone(name: str, now: float | None = None) -> bool:
    """Unlink the temporary file ``name`` of a creator that died before renaming it: a regular
    file nobody holds a lock on (a live creator holds a shared one from right after O_CREAT)
    and older than ``CREATING_GRACE_S`` (so never in the instant between O_CREAT and flock)."""
    if _CREATING_RE.match(name) is None:
        return False
    path = SHM_DIR / name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError:  # gone, a symbolic link, or not ours to open
        return False
    try:
        st = os.fstat(fd)
        age = (time.time() if now is None else now) - st.st_mtime
        if not stat.S_ISREG(st.st_mode) or age < CREATING_GRACE_S:
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: its creator lives
        now_at = os.lstat(path)
        if (now_at.st_dev, now_at.st_ino) != (st.st_dev, st.st_ino):  # renamed over meanwhile
            return False
        os.unlink(path)  # under our lock
    except OSError:
        return False
    finally:
        os.close(fd)
    logger.warning(
        "shm: unlinked %s (%d bytes, %.0fs old): its creator died before naming it", name, st.st_size, age
    )
    return True


def sweep_orphans() -> list[str]:
    """Unlink every kvwarden segment whose owner process is gone, and every temporary file of a
    creator that died before naming its segment; returns their names."""
    segments: list[str] = []
    temporary: list[str] = []
    try:
        entries = list(SHM_DIR.iterdir())
    except FileNotFoundError:
        return []
    now = time.time()
    for path in entries:
        if path.name.startswith(PREFIX) and unlink_if_owner_gone(path.name):
            segments.append(path.name)
        elif path.name.startswith(CREATING_PREFIX) and unlink_if_creator_gone(path.name, now):
            temporary.append(path.name)
    if segments:
        logger.warning("shm: swept %d orphaned segment(s) at start", len(segments))
    if temporary:
        logger.warning("shm: swept %d abandoned temporary file(s) at start", len(temporary))
    return segments + temporary
