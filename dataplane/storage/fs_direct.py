"""A chunk file read in place: from the page cache straight into the worker's blocks.

A warm chunk file (its pages in the page cache) needs no staging buffer: `read_resident` copies
its payload into the destination views (the worker's blocks, in the value's order) with
``RWF_NOWAIT``, so the kernel answers from memory or refuses (``EAGAIN``, or a short read) and
never waits on the disk: a read in place cannot stall on a dead mount, and needs no deadline.
It reads in pieces of `PIECE` bytes and hashes each piece right after it lands, while it is
still in the core's caches (hashing on another thread, behind the read, measured no faster
here: the hand-offs cost what the overlap saved); the value is checked whole before the
caller reports a byte of it. One pass over
the bytes on the request's path instead of three (disk -> L1, the check over L1, L1 -> the
worker).

Anything short of a whole file in memory (a page missing, a file system without
``RWF_NOWAIT``) answers False: the caller reads the file the staged way (into L1, on the I/O
threads, under the deadline), which overwrites whatever the attempt left in the blocks.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

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
