"""The file tier's disk operations on one chunk file: read it checked, write it whole, remove it.

Every function here makes disk calls and may block as long as the file system does: the file
tier runs them on its I/O threads or its writer, never on a thread that serves requests.
A file that fails a check of `codec` (truncated, damaged, foreign: another key's, another
layout's, not a kvwarden chunk, not a regular file) raises `BadFile` naming its kind; the tier
counts it, removes the file and answers a miss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import stat
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import xxhash

from dataplane.storage.codec import (
    MAX_HEADER,
    Header,
    RemoteValueError,
    check_digest,
    check_header,
    encode_header,
    value_hasher,
)
from dataplane.storage.compress import NONE, CodedChunkError, decode_into
from dataplane.storage.fs.layout import PAYLOAD_AT, tmp_path

# bytes read, then hashed, at a time: hashed while the core's L2 still holds them. A whole
# 32 MiB chunk hashed after its read comes back from memory at a third of the speed: read and
# checked in pieces of this size, a chunk file into L1 took 6.3 ms here against 8.0-8.4 ms
PIECE = 256 << 10

# what a failed disk call was, for the counters (`failure_kind`)
FAILURE_KINDS = ("timeout", "no_space", "read_only", "vanished", "io", "error")
_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK  # a planted FIFO cannot block


class BadFile(Exception):
    """A chunk file that must not be served; ``kind`` as `codec.VALUE_ERROR_KINDS`."""

    def __init__(self, kind: str, detail: str, ino: int | None = None) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.ino = ino  # the file's inode: remove it only if the path still names it


def failure_kind(exc: BaseException) -> str:
    """The counter a failed disk call goes to."""
    if not isinstance(exc, OSError):
        return "error"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return "no_space"
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return "read_only"
    if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ESTALE):
        return "vanished"
    if exc.errno == errno.EIO:
        return "io"
    return "error"


def file_header(key: bytes, payload: memoryview | bytes, codec: int = NONE, raw_nbytes: int = 0) -> bytes:
    """What a chunk file holds before ``payload``: its checked header, then zeros up to
    `PAYLOAD_AT`. A coded payload (``codec``) names the ``raw_nbytes`` it decodes to."""
    raw = memoryview(payload).nbytes if codec == NONE else raw_nbytes
    head = encode_header(key, "uint8", (raw,), payload, codec)
    return head + bytes(PAYLOAD_AT - len(head))


@dataclass(frozen=True)
class Opened:
    """A chunk file open for reading, its header checked (`open_chunk`); the caller closes ``fd``."""

    fd: int
    head: bytes  # the first bytes of the file: the header, and the value hash in it
    header: Header
    ino: int
    mtime: float
    size: int


def open_chunk(path: str, key: bytes, nbytes: int | None) -> Opened | None:
    """``path`` opened and its header checked against ``key`` (and ``nbytes``, when given); None
    when the file is not there. BadFile when it fails a check, OSError when the disk fails."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BadFile("format", "a symbolic link, not a chunk file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadFile("format", "not a regular file", st.st_ino)
        head = os.pread(fd, MAX_HEADER, 0)
        try:
            shape = None if nbytes is None else (nbytes,)
            h = check_header(key, head, st.st_size, "uint8", shape, payload_at=PAYLOAD_AT)
        except RemoteValueError as exc:
            raise BadFile(exc.kind, str(exc), st.st_ino) from None
    except BaseException:
        os.close(fd)
        raise
    return Opened(fd, head, h, st.st_ino, st.st_mtime, st.st_size)


class Progress(Protocol):
    """Who follows a read as it lands (`resident.Landing`): told the file and its buffer, then
    each piece of ``piece`` bytes as it lands (``add`` False: stop reading, nobody waits)."""

    piece: int

    def started(self, f: Opened, buf: memoryview) -> None: ...

    def add(self, n: int) -> bool: ...


def read_chunk(
    path: str,
    key: bytes,
    nbytes: int | None,
    alloc: Callable[[int], memoryview | None],
    progress: Progress | None = None,
) -> tuple[memoryview, float, int] | None:
    """The payload of ``path`` read into ``alloc(size)``'s buffer after every check, the
    file's modification time and its size; None when the file is not there (FileNotFoundError is a miss) or
    ``alloc`` has no room. BadFile when it fails a check (the buffer was written: the caller
    gives it back), OSError when the disk fails. With ``progress``, what has landed is reported
    as it lands (``progress.piece`` bytes or more at a time), and the value is checked here once
    whole: a follower may copy the bytes on before they are checked, and learns the check from
    this call. A read the follower gave up (``add`` False) stops unchecked."""
    f = open_chunk(path, key, nbytes)
    if f is None:
        return None
    try:
        dest = alloc(f.header.raw_nbytes)
        if dest is None:
            return None
        if f.header.codec != NONE:
            _read_coded(f, dest, progress)
            return dest, f.mtime, f.size
        try:
            h = value_hasher(f.head, f.header)
            if progress is not None:
                progress.started(f, dest)
            if _read_exact(f.fd, dest, f.header, h, progress):
                check_digest(f.head, f.header, h.intdigest())
        except RemoteValueError as exc:
            raise BadFile(exc.kind, str(exc), f.ino) from None
        return dest, f.mtime, f.size
    finally:
        os.close(f.fd)


def _read_coded(f: Opened, dest: memoryview, progress: Progress | None) -> None:
    """A coded payload read whole and checked, then decoded into ``dest`` (its raw bytes); a
    follower is told of the raw chunk once it is all there."""
    coded = memoryview(bytearray(f.header.nbytes))
    try:
        h = value_hasher(f.head, f.header)
        _read_exact(f.fd, coded, f.header, h, None)
        check_digest(f.head, f.header, h.intdigest())
        decode_into(f.header.codec, coded, dest)
    except RemoteValueError as exc:
        raise BadFile(exc.kind, str(exc), f.ino) from None
    except CodedChunkError as exc:
        raise BadFile("format", f"a coded payload that does not decode: {exc}", f.ino) from None
    if progress is not None:
        raw = dataclasses.replace(f.header, nbytes=dest.nbytes, codec=NONE)
        progress.started(dataclasses.replace(f, header=raw), dest)
        progress.add(dest.nbytes)


def _read_exact(
    fd: int, dest: memoryview, h: Header, hashed: xxhash.xxh3_64, progress: Progress | None
) -> bool:
    """The payload into ``dest``, `PIECE` bytes a read, each hashed into ``hashed`` as it lands
    and reported to ``progress`` (every ``progress.piece`` bytes, and at the end): whether it
    was read whole (False: the follower gave up; the rest is nobody's)."""
    got, told, pos = 0, 0, h.start
    while got < h.nbytes:
        n = os.preadv(fd, [dest[got : got + PIECE]], pos + got)
        if n == 0:  # shorter than its header says: cut while we read
            raise RemoteValueError("truncated", f"{got} payload bytes, header says {h.nbytes}")
        hashed.update(dest[got : got + n])
        got += n
        if progress is not None and (got - told >= progress.piece or got == h.nbytes):
            if not progress.add(got - told):
                return False
            told = got
    return True


def write_chunk(path: str, root: str, parts: Sequence[bytes | memoryview]) -> int:
    """Write ``parts`` to ``path`` as one file, published whole by a rename (its directories made
    as needed below ``root``, never ``root`` itself: a vanished mount is not re-created on the
    disk beneath it); the bytes written. OSError on failure, nothing left behind."""
    tmp = tmp_path(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except FileNotFoundError:
        if not os.path.isdir(root):
            raise
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    total = 0
    try:
        try:
            views = [memoryview(p).cast("B") for p in parts]
            want = sum(v.nbytes for v in views)
            while views:
                n = os.writev(fd, views)
                total += n
                while views and n >= views[0].nbytes:
                    n -= views[0].nbytes
                    views.pop(0)
                if views and n:
                    views[0] = views[0][n:]
        finally:
            os.close(fd)
        if total != want:
            raise OSError(errno.EIO, f"wrote {total} of {want} bytes")
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return total


def remove_if(path: str, ino: int | None) -> None:
    """Remove the file ``path`` names if it is still inode ``ino`` (any file with None): a bad
    file another server has since replaced with a good one stays."""
    with contextlib.suppress(OSError):
        if ino is None or os.stat(path, follow_symlinks=False).st_ino == ino:
            os.unlink(path)


def remove(path: str) -> bool:
    """Remove a chunk file; False when it was gone already (another server removed it)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def exists(path: str) -> int | None:
    """The size of the regular file ``path``, None when there is none."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def touch(path: str) -> None:
    """Mark a chunk used now (its modification time: the eviction order survives restarts)."""
    with contextlib.suppress(OSError):  # (removed or replaced meanwhile: nothing to mark)
        os.utime(path)


def free_bytes(root: str) -> int | None:
    """Bytes an unprivileged writer may still use under ``root`` (None: the file system does
    not say). A quota (EDQUOT) is not seen here: only a write finds it."""
    try:
        st = os.statvfs(root)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def probe(root: str) -> bool:
    """Write a probe file under ``root``, read it back and remove it: True when equal."""
    path = os.path.join(root, f".probe.{os.getpid()}.{threading.get_ident()}")
    data = os.urandom(64)
    write_chunk(path, root, (data,))
    try:
        with open(path, "rb") as f:
            return f.read() == data
    finally:
        remove(path)
