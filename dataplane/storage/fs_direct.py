"""A chunk file read in place: from the page cache straight into the worker's blocks.

A warm chunk file (its pages in the page cache) needs no staging buffer: `read_resident` copies
its payload into the destination views (the worker's blocks, in the value's order) with
``RWF_NOWAIT``, so the kernel answers from memory or refuses (``EAGAIN``, or a short read) and
never waits on the disk: a read in place cannot stall on a dead mount, and needs no deadline.
It reads in pieces of `PIECE` bytes and hashes each piece right after it lands, while it is
still in the caches: on `PieceHasher`'s thread, behind the read (on this thread when that one
is busy); the value is checked whole before the caller reports a byte of it. One pass over
the bytes on the request's path instead of three (disk -> L1, the check over L1, L1 -> the
worker).

Anything short of a whole file in memory (a page missing, a file system without
``RWF_NOWAIT``) answers False: the caller reads the file the staged way (into L1, on the I/O
threads, under the deadline), which overwrites whatever the attempt left in the blocks.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from dataplane.storage.fs_files import BadFile, Opened
from dataplane.storage.remote_codec import RemoteValueError, check_digest, value_hasher

PIECE = 1 << 20  # bytes read, then hashed, at a time: a core's L2 holds them
_IOV_MAX = 1024
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)  # Linux only; 0: never in place
_NOT_IN_MEMORY = (errno.EAGAIN, errno.EWOULDBLOCK)
_UNSUPPORTED = (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)


class Unsupported(Exception):
    """The file system does not read with ``RWF_NOWAIT``: reads in place never work on it."""


def supported() -> bool:
    return bool(_NOWAIT)


class PieceHasher:
    """The thread ``kvwarden-fs-hash`` (start/stop/join): hashes the pieces of a read in place
    right behind the read, on another core, so the check costs next to nothing on the
    request's path. One read at a time; a read that finds it busy hashes on its own thread."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # leaf: guards _busy
        self._busy = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvwarden-fs-hash", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._jobs.put(None)

    def join(self, timeout_s: float = 5.0) -> bool:
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self._thread is None or not self._thread.is_alive()

    def take(self) -> bool:
        """Reserve the thread for one read (False: busy, or not running)."""
        with self._lock:
            if self._busy or self._thread is None or not self._thread.is_alive():
                return False
            self._busy = True
            return True

    def give_back(self) -> None:
        with self._lock:
            self._busy = False

    def submit(self, job: _Job) -> None:
        self._jobs.put(job)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                while (group := job.pieces.get()) is not None:
                    for v in group:
                        job.hash.update(v)
            finally:
                job.done.set()


@dataclass(eq=False)
class _Job:
    hash: xxhash.xxh3_64
    pieces: queue.SimpleQueue[list[memoryview] | None] = field(default_factory=queue.SimpleQueue)
    done: threading.Event = field(default_factory=threading.Event)


def read_resident(f: Opened, views: Sequence[memoryview], hasher: PieceHasher | None = None) -> bool:
    """``f``'s payload copied into ``views`` (bytes, in order, as long as the payload in all)
    and checked, if the page cache holds all of it: True. False when it does not (the views may
    hold part of it: the caller overwrites them). BadFile when the value fails its check,
    `Unsupported` when the file system refuses the flag, ValueError when the views do not add up
    to the payload, OSError when the disk fails. ``hasher``: hashes behind the read, if free."""
    if not _NOWAIT:
        raise Unsupported("RWF_NOWAIT is not available on this platform")
    total = sum(v.nbytes for v in views)
    if total != f.header.nbytes:
        raise ValueError(f"destination of {total} bytes for a payload of {f.header.nbytes}")
    job = _Job(value_hasher(f.head, f.header))
    helper = hasher if hasher is not None and hasher.take() else None
    if helper is not None:
        helper.submit(job)
    try:
        whole = _read(f, _pieces(views), job if helper is not None else None, job.hash)
    finally:
        if helper is not None:
            job.pieces.put(None)
            job.done.wait()  # (the views are not read after this returns)
            helper.give_back()
    if not whole:
        return False
    try:
        check_digest(f.head, f.header, job.hash.intdigest())
    except RemoteValueError as exc:
        raise BadFile(exc.kind, str(exc), f.ino) from None
    return True


def _read(f: Opened, groups: list[list[memoryview]], job: _Job | None, h: xxhash.xxh3_64) -> bool:
    """Read ``groups`` in order, each handed to ``job`` (else hashed here) once it landed."""
    pos = f.header.start
    for group in groups:
        want = sum(v.nbytes for v in group)
        try:
            n = os.preadv(f.fd, group, pos, _NOWAIT)
        except OSError as exc:
            if exc.errno in _NOT_IN_MEMORY:
                return False
            if exc.errno in _UNSUPPORTED:
                raise Unsupported(os.strerror(exc.errno)) from None
            raise
        if n < want:  # not all in memory, or the file is shorter now than its header said
            end = os.fstat(f.fd).st_size
            if pos + n >= end:
                short = f.header.start + f.header.nbytes - end
                raise BadFile("truncated", f"the file ended {short} bytes early", f.ino)
            return False
        if job is not None:
            job.pieces.put(group)
        else:
            for v in group:
                h.update(v)
        pos += n
    return True


def _pieces(views: Sequence[memoryview]) -> list[list[memoryview]]:
    """``views`` cut into groups of about `PIECE` bytes (at most `_IOV_MAX` views each)."""
    groups: list[list[memoryview]] = []
    cur: list[memoryview] = []
    size = 0
    for v in views:
        v = v.cast("B") if v.format != "B" or v.ndim != 1 else v
        for at in range(0, v.nbytes, PIECE):
            part = v[at : at + PIECE]
            cur.append(part)
            size += part.nbytes
            if size >= PIECE or len(cur) == _IOV_MAX:
                groups.append(cur)
                cur, size = [], 0
    if cur:
        groups.append(cur)
    return groups
