"""Chunk files read into the worker's blocks: in place when warm, followed as they land when cold.

**In place** (`read_resident`): a warm chunk file (its pages in the page cache) needs no
staging buffer. Its payload is copied into the destination views (the worker's blocks, in the
value's order) with ``RWF_NOWAIT``, so the kernel answers from memory or refuses (``EAGAIN``, or
a short read) and never waits on the disk: a read in place cannot stall on a dead mount, and
needs no deadline. It reads `PIECE` bytes at a time and hashes each piece right after it
lands, while it is still in the core's caches (hashing on another thread behind the read
measured no faster here: the hand-offs cost what the overlap saved); the value is checked whole
before the caller counts a byte of it. One pass over the bytes on the request's path instead of
three (disk -> L1, the check over L1, L1 -> the worker). Anything short of a whole file in
memory (a page missing, a file system without ``RWF_NOWAIT``) answers False: the caller reads
the file the staged way, which overwrites whatever the attempt left in the blocks.

**Several at once** (`CopyGate`): the chunks of one RETRIEVE are read in place side by side,
each on an I/O thread that opens the file, checks its header, then copies and checks it. The
open may outlive the request's deadline; the copy may start only while the request still waits
(`CopyGate.enter`), and the request, before it returns, shuts the gate and waits for the copies
under way (`CopyGate.shut`: they never wait on the disk), so nothing lands in the worker's blocks
once the RETRIEVE has answered.

**Followed** (`fs_files.read_chunk` with a `Landing` on an I/O thread, `follow` on the
request's): a cold file is read into a staging buffer (L1's) `STAGE_PIECE` bytes at a time,
and the request's thread hashes each piece and copies it on into the views as it lands
(`Landing` passes the progress), so the copy ends soon after the disk does. The views are
written from the staging buffer only, by the follower, which stops at its deadline: a read
that outlives it lands nowhere else.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Sequence

import xxhash

from dataplane.storage.fs_files import BadFile, Opened
from dataplane.storage.remote_codec import RemoteValueError, check_digest, value_hasher

PIECE = 1 << 20  # bytes read, then hashed, at a time: a core's L2 holds them
STAGE_PIECE = 4 << 20  # bytes a staged read reports at a time to the thread that follows it
_IOV_MAX = 1024
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)  # Linux only; 0: never in place
_NOT_IN_MEMORY = (errno.EAGAIN, errno.EWOULDBLOCK)
_UNSUPPORTED = (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)


class Unsupported(Exception):
    """The file system does not read with ``RWF_NOWAIT``: reads in place never work on it."""


def supported() -> bool:
    return bool(_NOWAIT)


class CopyGate:
    """Copies into a request's views start only while the request waits for them."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())  # leaf: guards _open and _copying
        self._open = True
        self._copying = 0

    def enter(self) -> bool:
        """A copy may start (then `leave` after it); False once the request stopped waiting."""
        with self._cond:
            if self._open:
                self._copying += 1
            return self._open

    def leave(self) -> None:
        with self._cond:
            self._copying -= 1
            self._cond.notify_all()

    def shut(self) -> None:
        """No copy starts from now on; returns once those under way have ended."""
        with self._cond:
            self._open = False
            while self._copying:
                self._cond.wait()


def read_resident(f: Opened, views: Sequence[memoryview]) -> bool:
    """``f``'s payload copied into ``views`` (bytes, in order, as long as the payload in all)
    and checked, if the page cache holds all of it: True. False when it does not (the views may
    hold part of it: the caller overwrites them). BadFile when the value fails its check,
    `Unsupported` when the file system refuses the flag, ValueError when the views do not add up
    to the payload, OSError when the disk fails."""
    if not _NOWAIT:
        raise Unsupported("RWF_NOWAIT is not available on this platform")
    total = sum(v.nbytes for v in views)
    if total != f.header.nbytes:
        raise ValueError(f"destination of {total} bytes for a payload of {f.header.nbytes}")
    h = value_hasher(f.head, f.header)
    if not _read(f, _pieces(views), h):
        return False
    try:
        check_digest(f.head, f.header, h.intdigest())
    except RemoteValueError as exc:
        raise BadFile(exc.kind, str(exc), f.ino) from None
    return True


def _read(f: Opened, groups: list[list[memoryview]], h: xxhash.xxh3_64) -> bool:
    """Read ``groups`` in order into their views, each hashed into ``h`` once it landed."""
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


class Landing:
    """A chunk file being read into a staging buffer on an I/O thread (`fs_files.read_chunk`
    with this as its progress; the reader calls `end` when it stops), for the
    thread that follows the read (`follow`): the file's header and the buffer once they are
    known, how many payload bytes have landed, whether the read is over. ``_cond`` guards
    every field."""

    piece = STAGE_PIECE

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self.opened: Opened | None = None
        self.buf: memoryview | None = None
        self.landed = 0
        self.over = False
        self.abandoned = False  # the follower gave up: the reader stops at its next piece

    def started(self, f: Opened, buf: memoryview) -> None:
        with self._cond:
            self.opened, self.buf = f, buf
            self._cond.notify_all()

    def add(self, n: int) -> bool:
        """``n`` more bytes landed; False once the follower gave up."""
        with self._cond:
            self.landed += n
            self._cond.notify_all()
            return not self.abandoned

    def end(self) -> None:
        with self._cond:
            self.over = True
            self._cond.notify_all()

    def abandon(self) -> None:
        with self._cond:
            self.abandoned = True

    def wait(self, want: int, deadline: float) -> int:
        """Bytes landed once ``want`` have (or the read is over, or the deadline passed)."""
        with self._cond:
            self._cond.wait_for(
                lambda: (self.buf is not None and self.landed >= want) or self.over,
                max(0.0, deadline - time.monotonic()),
            )
            return self.landed if self.buf is not None else -1


def follow(landing: Landing, views: Sequence[memoryview] | None, deadline: float) -> bool:
    """Follow a read into ``landing`` on this thread: hash each piece as it lands and copy it on into
    ``views`` (the worker's blocks; None, or views of another size: only hash). True when the
    whole payload landed and checked; False when the read ended short or the deadline passed
    (the caller finishes the read's call to learn why). BadFile when it fails its check.
    Reads only the staging buffer: a read that outlives the deadline writes nowhere else."""
    got = landing.wait(1, deadline)
    f, buf = landing.opened, landing.buf
    if got < 0 or f is None or buf is None:
        return False
    total = f.header.nbytes
    if views is not None and sum(v.nbytes for v in views) != total:
        views = None
    h = value_hasher(f.head, f.header)
    spans = _spans(views) if views is not None else []
    done = k = 0
    while done < total:
        got = landing.wait(min(total, done + STAGE_PIECE), deadline)
        if got <= done:
            return False
        piece = buf[done:got]
        h.update(piece)
        k = _copy(piece, done, spans, k)
        done = got
    try:
        check_digest(f.head, f.header, h.intdigest())
    except RemoteValueError as exc:
        raise BadFile(exc.kind, str(exc), f.ino) from None
    return True


def _spans(views: Sequence[memoryview]) -> list[tuple[int, memoryview]]:
    """Each view (as bytes) with the value offset it starts at."""
    out, at = [], 0
    for v in views:
        out.append((at, v.cast("B") if v.format != "B" or v.ndim != 1 else v))
        at += v.nbytes
    return out


def _copy(piece: memoryview, start: int, spans: list[tuple[int, memoryview]], k: int) -> int:
    """Copy ``piece`` (the value's bytes from ``start``) into the views it covers, from span
    ``k`` on; the span the next piece starts in."""
    end = start + piece.nbytes
    while k < len(spans):
        at, v = spans[k]
        lo, hi = max(at, start), min(at + v.nbytes, end)
        if lo < hi:
            v[lo - at : hi - at] = piece[lo - start : hi - start]
        if at + v.nbytes > end:
            break  # (it goes on in the next piece)
        k += 1
    return k
