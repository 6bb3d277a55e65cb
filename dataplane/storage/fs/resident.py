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
the file the staged way, which overwrites whatever the attempt left in the blocks. A large
payload is copied in parts by idle I/O threads beside the request's (`Parts`); the request's
thread hashes them in order behind the copies.

**Several at once** (`CopyGate`): the chunks of one RETRIEVE are read in place side by side,
each on an I/O thread that opens the file, checks its header, then copies and checks it. The
open may outlive the request's deadline; the copy may start only while the request still waits
(`CopyGate.enter`), and the request, before it returns, shuts the gate and waits for the copies
under way (`CopyGate.shut`: they never wait on the disk), so nothing lands in the worker's blocks
once the RETRIEVE has answered.

**Followed** (`chunk_file.read_chunk` with a `Landing` on an I/O thread, `follow` on the
request's): a cold file is read into a staging buffer (L1's) `PIECE` bytes at a time, each
hashed by the reader as it lands (still in its core's caches), and reported every
`STAGE_PIECE` bytes; the request's thread copies each report on into the views meanwhile, so
the copy ends soon after the disk does, and the value's check is the read's answer. The
kernel's read-ahead lands a cold file in bursts (16 MiB at once, here), and a follower that
also hashed fell behind them: it ended ~3 ms after the disk; the two threads share the work
now. The views are written from the staging buffer only, by the follower, which stops at its
deadline: a read that outlives it lands nowhere else.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
import time
from collections.abc import Callable, Sequence

import xxhash

from dataplane.storage.codec import RemoteValueError, check_digest, value_hasher
from dataplane.storage.fs.chunk_file import PIECE as PIECE  # (read, then hashed, at a time: here too)
from dataplane.storage.fs.chunk_file import BadFile, Opened

MIN_PART = 8 << 20  # the least a thread copies of a payload read in parts (`Parts`)
STAGE_PIECE = 1 << 20  # bytes a staged read reports at a time to the thread that follows it
_IOV_MAX = 1024
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)  # Linux only; 0: never in place
_NOT_IN_MEMORY = (errno.EAGAIN, errno.EWOULDBLOCK)
_UNSUPPORTED = (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)


Submit = Callable[[Callable[[], object]], object]  # runs a call on another thread (`DiskPool.submit`)


class InPlaceRefused(Exception):
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


def read_resident(
    f: Opened, views: Sequence[memoryview], ways: int = 1, submit: Submit | None = None
) -> bool:
    """``f``'s payload copied into ``views`` (bytes, in order, as long as the payload in all)
    and checked, if the page cache holds all of it: True. False when it does not (the views may
    hold part of it: the caller overwrites them). BadFile when the value fails its check,
    `InPlaceRefused` when the file system refuses the flag, ValueError when the views do not add up
    to the payload, OSError when the disk fails. With ``ways`` > 1 and ``submit`` (`Parts`), the
    payload is cut in up to ``ways`` parts of at least `MIN_PART` bytes that other threads copy
    beside this one."""
    if not _NOWAIT:
        raise InPlaceRefused("RWF_NOWAIT is not available on this platform")
    total = sum(v.nbytes for v in views)
    if total != f.header.nbytes:
        raise ValueError(f"destination of {total} bytes for a payload of {f.header.nbytes}")
    h = value_hasher(f.head, f.header)
    groups = _pieces(views)
    parts = _split(groups, f.header.start, min(ways, total // MIN_PART)) if submit is not None else []
    if len(parts) > 1 and submit is not None:
        ok = Parts(f, parts).read(h, submit)
    else:
        ok = _read(f, groups, h, f.header.start)
    if not ok:
        return False
    try:
        check_digest(f.head, f.header, h.intdigest())
    except RemoteValueError as exc:
        raise BadFile(exc.kind, str(exc), f.ino) from None
    return True


class Parts:
    """A payload read in place in parts, by this thread and the threads ``submit`` runs calls
    on: each part is copied by whoever takes it first (a part no other thread has started when
    this one gets to it, it copies itself: a pool that is busy, or stuck in a dead mount's
    ``open``, costs nothing but the overlap). This thread hashes every part in order, a part it
    copied as it lands, another's once it is over. Nothing touches the file or the views once
    `read` has returned: a part not started by then never starts, and `read` waits for those
    under way (they never wait on the disk). ``_cond`` guards ``_state``, ``_ok`` and
    ``_error``."""

    FREE, TAKEN, OVER = 0, 1, 2

    def __init__(self, f: Opened, parts: list[tuple[int, list[list[memoryview]]]]) -> None:
        self._f, self._parts = f, parts
        self._cond = threading.Condition(threading.Lock())  # leaf: see the class docstring
        self._state = [self.FREE] * len(parts)
        self._ok = [False] * len(parts)
        self._error: list[BaseException | None] = [None] * len(parts)

    def read(self, h: xxhash.xxh3_64, submit: Submit) -> bool:
        """All parts copied into their views and hashed into ``h`` in order: True; False as soon
        as one is not all in memory. A part's exception (a helper's too) is raised here."""
        for i in range(len(self._parts) - 1, 0, -1):  # the last first: this thread starts at 0
            submit(functools.partial(self._run, i, None))
        try:
            for i, (_, groups) in enumerate(self._parts):
                ran = self._run(i, h)  # copied and hashed here, unless a helper took it
                with self._cond:
                    self._cond.wait_for(lambda i=i: self._state[i] == self.OVER)  # type: ignore[misc]
                    ok, err = self._ok[i], self._error[i]
                if err is not None:
                    raise err
                if not ok:
                    return False
                if not ran:  # (a helper copied it: hashed here, behind the copy)
                    for g in groups:
                        for v in g:
                            h.update(v)
            return True
        finally:
            with self._cond:  # parts never started stay so; those under way end
                self._state = [self.OVER if s == self.FREE else s for s in self._state]
                self._cond.wait_for(lambda: self.TAKEN not in self._state)

    def _run(self, i: int, h: xxhash.xxh3_64 | None) -> bool:
        """Copy part ``i`` (hashed into ``h`` if given) if nobody took it yet: whether it ran."""
        with self._cond:
            if self._state[i] != self.FREE:
                return False
            self._state[i] = self.TAKEN
        ok, err = False, None
        try:
            pos, groups = self._parts[i]
            ok = _read(self._f, groups, h, pos)
        except BaseException as exc:  # (this thread's or a helper's: raised in `read`)
            err = exc
        with self._cond:
            self._ok[i], self._error[i], self._state[i] = ok, err, self.OVER
            self._cond.notify_all()
        return True


def _split(groups: list[list[memoryview]], start: int, ways: int) -> list[tuple[int, list[list[memoryview]]]]:
    """``groups`` cut into at most ``ways`` runs of about equal bytes, each with its file offset."""
    total = sum(v.nbytes for g in groups for v in g)
    ways = max(1, min(ways, len(groups)))
    out: list[tuple[int, list[list[memoryview]]]] = []
    pos, done, cur = start, 0, []
    for g in groups:
        cur.append(g)
        done += sum(v.nbytes for v in g)
        if done * ways >= total * (len(out) + 1) and len(out) < ways - 1:
            out.append((pos, cur))
            pos, cur = start + done, []
    if cur:
        out.append((pos, cur))
    return out


def _read(f: Opened, groups: list[list[memoryview]], h: xxhash.xxh3_64 | None, pos: int) -> bool:
    """Read ``groups`` in order into their views from file offset ``pos``, each hashed into
    ``h`` (if given) once it landed."""
    for group in groups:
        want = sum(v.nbytes for v in group)
        try:
            n = os.preadv(f.fd, group, pos, _NOWAIT)
        except OSError as exc:
            if exc.errno in _NOT_IN_MEMORY:
                return False
            if exc.errno in _UNSUPPORTED:
                raise InPlaceRefused(os.strerror(exc.errno)) from None
            raise
        if n < want:  # not all in memory, or the file is shorter now than its header said
            end = os.fstat(f.fd).st_size
            if pos + n >= end:
                short = f.header.start + f.header.nbytes - end
                raise BadFile("truncated", f"the file ended {short} bytes early", f.ino)
            return False
        if h is not None:
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
    """A chunk file being read into a staging buffer on an I/O thread (`chunk_file.read_chunk`
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
    """Follow a read into ``landing`` on this thread: copy each piece on into ``views`` (the
    worker's blocks; None, or views of another size: only wait) as it lands. True when the
    whole payload landed; False when the read ended short or the deadline passed. Either way
    the caller finishes the read's call, which checked the value (BadFile when it failed: the
    views hold bytes that must not count). Reads only the staging buffer: a read that outlives
    the deadline writes nowhere else."""
    got = landing.wait(1, deadline)
    f, buf = landing.opened, landing.buf
    if got < 0 or f is None or buf is None:
        return False
    total = f.header.nbytes
    if views is not None and sum(v.nbytes for v in views) != total:
        views = None
    spans = _spans(views) if views is not None else []
    done = k = 0
    while done < total:
        got = landing.wait(min(total, done + STAGE_PIECE), deadline)
        if got <= done:
            return False
        k = _copy(buf[done:got], done, spans, k)
        done = got
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
