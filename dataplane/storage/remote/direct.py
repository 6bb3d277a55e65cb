"""GETs that land a chunk where it is going: a small RESP2 reader for the remote tier's reads.

redis-py reads a reply in 64 KiB pieces, copies them into its parser, and hands back a new
`bytes`, which the caller copies again into L1: three copies of every chunk and a hundred trips
through the interpreter for a 4 MiB value. Here the value's header is read first and checked,
then the payload is received straight into the buffer the caller gives for it (an L1 buffer),
in as few ``recv_into`` calls as the socket allows, each without the GIL. A remote RETRIEVE of
a 32 MiB chunk took half the time of a redis-py GET of it, against as long before
(`kvwarden bench remote`, BENCHMARKS.md). A chunk whose size the reader knows is asked for in
pipelined ranges (`_Value`: Redis sends each range while it builds the next, where a GET's
reply is built whole first): a 16 MiB chunk in 5-9 ms, against 14-16 ms in one GET. A coded
chunk is decoded piece by piece as it arrives (`dataplane.storage.compress.StreamDecoder`).

Only GET, STRLEN and GETRANGE are spoken, over connections of its own (plain TCP or a Unix
socket, `redis://` and `unix://` URLs, with AUTH, SELECT and CLIENT SETNAME as redis-py would
send them); writes, PING, the cluster client and TLS stay with redis-py (`DirectGets.for_url`
answers None for those, and the backend reads through redis-py). Failures raise redis-py's
exceptions (`redis.ConnectionError`, `redis.TimeoutError`, `redis.ResponseError` and its kinds), so the
backend counts them as it counts redis-py's; a connection that failed, or that a read left
mid-value, is closed, never reused. ``_lock`` guards ``_idle`` (a leaf lock).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

import redis
import xxhash
from redis import exceptions as rexc
from redis.connection import parse_url

from dataplane.storage.codec import (
    MAX_HEADER,
    Header,
    RemoteValueError,
    check_digest,
    check_expected,
    check_header,
    check_key,
    header_size,
    nbytes_of,
    value_hasher,
)
from dataplane.storage.compress import (
    CODECS,
    NONE,
    CodedChunkError,
    StreamDecoder,
    WholeDecoder,
    stream_decoder,
)

_LINE_READ = 4096  # what a read for a reply's first line takes from the socket at most
MAX_IDLE = 8  # connections kept open between reads
RANGE = 2 << 20  # a value the reader knows the size of is read in GETRANGEs of this many bytes
NO_ROOM = memoryview(b"")  # `DirectGets.read`: the value was there, the caller had no room for it


class NoRoom(Exception):
    """The buffer for a value could not be had (L1 full of pinned chunks)."""


class _Conn:
    """One connection: a socket and the bytes received past what was asked for."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def send(self, *args: bytes) -> None:
        self.sock.sendall(_command(*args))

    def line(self) -> bytes:
        """The next line of the reply (without CRLF)."""
        while True:
            at = self.buf.find(b"\r\n")
            if at >= 0:
                out = bytes(self.buf[:at])
                del self.buf[: at + 2]
                return out
            got = self.sock.recv(_LINE_READ)
            if not got:
                raise redis.ConnectionError("Redis closed the connection")
            self.buf += got

    def read_into(self, dst: memoryview) -> None:
        """Fill ``dst`` with the reply's next bytes."""
        n = min(len(self.buf), dst.nbytes)
        if n:
            dst[:n] = self.buf[:n]
            del self.buf[:n]
        while n < dst.nbytes:
            got = self.sock.recv_into(dst[n:], dst.nbytes - n)
            if not got:
                raise redis.ConnectionError("Redis closed the connection")
            n += got

    def simple(self) -> bytes:
        """A status reply's text; an error reply raises."""
        return self._reply(b"+")

    def integer(self) -> int:
        """An integer reply's value; an error reply raises."""
        return self._number(b":", "integer reply")

    def bulk_length(self) -> int:
        """The length of a bulk reply (-1: nil); an error reply raises."""
        return self._number(b"$", "bulk length")

    def _number(self, kind: bytes, what: str) -> int:
        text = self._reply(kind)
        try:
            return int(text)
        except ValueError:
            raise redis.ResponseError(f"bad {what} {kind + text[:40]!r}") from None

    def _reply(self, kind: bytes) -> bytes:
        """The next line, a reply of ``kind`` (its first byte), without that byte; an error
        reply raises its exception."""
        line = self.line()
        if line[:1] == b"-":
            raise _error(line[1:].decode(errors="replace"))
        if line[:1] != kind:
            raise redis.ResponseError(f"unexpected reply {line[:40]!r}")
        return line[1:]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class _Value:
    """A value's bytes as they come off a connection: one GET's bulk reply, or, where the
    reader knows about how big the value is, the replies of pipelined GETRANGEs of `RANGE`
    bytes each after its STRLEN. Redis builds a reply whole in memory before it sends a byte of
    it (a fresh buffer for a large value, page by page): a 16 MiB GET waited 10 ms for its first
    byte here and took 15 ms in all; 2 MiB ranges are sent while the next is built, from
    buffers Redis reuses (5 ms). The ranges are not one atomic read: a value that changed or
    went between them (another server's write of the same key, a clear) shows as a range of
    another length (`RemoteValueError` "truncated") or fails the value hash, a miss either way."""

    def __init__(self, conn: _Conn, total: int, lengths: list[int]) -> None:
        self.conn = conn
        self.total = total  # the value's size
        self._lengths = lengths  # the bulk replies still to come, by their length
        self._left = 0  # bytes still to read of the reply being read
        self._open = False  # a reply is being read

    @classmethod
    def ask(cls, conn: _Conn, name: bytes, expect: int | None) -> _Value | None:
        """The value of ``name`` asked for (None: Redis holds nothing under it): ranged where
        ``expect`` (the size it likely has) is known, else one GET."""
        if expect is None or expect <= 0:
            conn.send(b"GET", name)
            total = conn.bulk_length()
            return None if total < 0 else cls(conn, total, [total])._began()
        asks, lengths = _ranges(name, 0, expect)
        conn.sock.sendall(_command(b"STRLEN", name) + asks)
        total = conn.integer()
        value = cls(conn, total, [max(0, min(n, total - a)) for a, n in lengths])
        if total > expect:  # (larger than the layout asked for: the rest in more ranges)
            asks, more = _ranges(name, expect, total)
            conn.sock.sendall(asks)
            value._lengths += [n for _, n in more]
        if total == 0:  # (a missing key: STRLEN 0, and every range empty)
            value.end()
            return None
        return value

    def _began(self) -> _Value:
        self._lengths.pop(0)
        self._left, self._open = self.total, True
        return self

    def read_into(self, dst: memoryview) -> None:
        """Fill ``dst`` with the value's next bytes."""
        n = 0
        while n < dst.nbytes:
            if not self._open:
                self._next_reply()
                continue
            k = min(self._left, dst.nbytes - n)
            self.conn.read_into(dst[n : n + k])
            n += k
            self._left -= k
            if self._left == 0:
                self._close_reply()

    def end(self) -> None:
        """Read what is left of the replies (the empty ranges past a shorter value's end);
        RemoteValueError ("truncated") where one holds bytes the value was not to have."""
        if self._open:
            if self._left:
                raise RemoteValueError("truncated", f"{self._left} bytes of the value were left unread")
            self._close_reply()
        while self._lengths:
            self._next_reply()
            if self._left:
                raise RemoteValueError("truncated", "the value grew while it was read")
            self._close_reply()

    def _next_reply(self) -> None:
        if not self._lengths:
            raise RemoteValueError("truncated", "the value's bytes ran out before its end")
        want = self._lengths.pop(0)
        got = self.conn.bulk_length()
        if got != want:
            raise RemoteValueError("truncated", f"a range of {got} bytes, not {want}: the value changed")
        self._left, self._open = got, True

    def _close_reply(self) -> None:
        if self.conn.line() != b"":
            raise redis.ResponseError("a bulk reply without its CRLF")
        self._open = False


def _ranges(name: bytes, start: int, end: int) -> tuple[bytes, list[tuple[int, int]]]:
    """The GETRANGEs of `RANGE` bytes that cover bytes ``start`` to ``end`` of ``name``, and
    each one's (offset, length)."""
    spans = [(a, min(a + RANGE, end) - a) for a in range(start, end, RANGE)]
    asks = b"".join(_command(b"GETRANGE", name, b"%d" % a, b"%d" % (a + n - 1)) for a, n in spans)
    return asks, spans


def _command(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def _receive_decoding(
    value: _Value, decoder: StreamDecoder | WholeDecoder, early: memoryview, hasher: xxhash.xxh3_64
) -> None:
    """The payload received through ``decoder`` piece by piece (``early``: its first bytes,
    read with the header), each piece hashed as it lands."""
    while (buf := decoder.next_buffer()) is not None:
        k = min(early.nbytes, buf.nbytes)
        buf[:k] = early[:k]
        early = early[k:]
        value.read_into(buf[k:])
        hasher.update(buf)
        decoder.filled()


def _error(text: str) -> redis.RedisError:
    """redis-py's exception for an error reply (its kinds by prefix, as its parser maps them)."""
    if text.startswith(("NOAUTH", "WRONGPASS", "ERR invalid password", "ERR AUTH")):
        return rexc.AuthenticationError(text)
    if text.startswith("NOPERM"):
        return rexc.NoPermissionError(text)
    if text.startswith("OOM"):
        return rexc.OutOfMemoryError(text)
    return redis.ResponseError(text)


class DirectGets:
    """GET into a caller's buffer, over a few connections of its own (any thread)."""

    def __init__(self, params: dict[str, Any], timeout_s: float) -> None:
        self._params = params
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # leaf: guards _idle
        self._idle: list[_Conn] = []

    @classmethod
    def for_url(cls, url: str, password: str | None, timeout_s: float) -> DirectGets | None:
        """The reader for ``url``; None where redis-py must read (a cluster, TLS, a URL it does
        not parse plainly)."""
        if not url.startswith(("redis://", "unix://")):
            return None
        try:
            params: dict[str, Any] = parse_url(url)  # type: ignore[no-untyped-call]
        except ValueError:
            return None
        if params.get("connection_class") not in (None, redis.UnixDomainSocketConnection):
            return None
        if password is not None:
            params["password"] = password
        return cls(params, timeout_s)

    def read(
        self,
        key: bytes,
        name: str,
        dtype: str,
        shape: Sequence[int] | None,
        alloc: Callable[[int], memoryview | None] | None,
        give_back: Callable[[memoryview], None] | None,
    ) -> memoryview | None:
        """The payload of chunk ``key`` (stored as ``name``), checked as `codec.decode` checks a
        value (a damaged value is "checksum" whatever it claims, then the key, then the layout:
        `RemoteValueError`), received into ``alloc``'s buffer (a new one without ``alloc``, and
        for a value of another layout); None: Redis holds nothing under ``name``; `NO_ROOM`:
        ``alloc`` had none. A buffer ``alloc`` gave for a read that failed goes to
        ``give_back``; Redis's failures raise redis-py's exceptions."""
        given: list[memoryview] = []
        want = None if shape is None else tuple(shape)

        def into(h: Header) -> memoryview | StreamDecoder | WholeDecoder | None:
            fits = h.dtype == dtype and want in (None, h.shape)  # (else a buffer of its own)
            size = h.raw_nbytes  # (a coded payload is decoded as it arrives, into this buffer)
            buf = alloc(size) if alloc is not None and fits else memoryview(bytearray(size))
            if buf is None:
                return None
            if alloc is not None and fits:
                given.append(buf)
            if h.codec == NONE:
                return buf
            try:
                return stream_decoder(h.codec, buf, h.nbytes)
            except CodedChunkError as exc:
                raise RemoteValueError("format", str(exc)) from None

        try:
            expect = None if shape is None else header_size(len(shape)) + nbytes_of(dtype, shape)
            got = self.get_into(name, into, lambda head, total: check_header(None, head, total), expect)
            if got is None:
                return None
            head, payload, decoder = got
            check_key(key, head)
            check_expected(head, dtype, shape)
            if decoder is not None:
                try:
                    decoder.finish()
                except CodedChunkError as exc:
                    what = f"a {CODECS.get(head.codec)} payload that does not decode"
                    raise RemoteValueError("format", f"{what}: {exc}") from None
            return payload
        except NoRoom:
            return NO_ROOM
        except BaseException:
            if given and give_back is not None:
                give_back(given[0])
            raise

    def get_into(
        self,
        name: str,
        alloc: Callable[[Header], memoryview | StreamDecoder | WholeDecoder | None],
        header_of: Callable[[bytes, int], Header],
        expect: int | None = None,
    ) -> tuple[Header, memoryview, StreamDecoder | WholeDecoder | None] | None:
        """Read ``name`` (in ranges where ``expect``, the size the value likely has, is given:
        `_Value`): None when Redis holds nothing under it; else the value's header (checked
        by ``header_of(first bytes, total)``, which raises `RemoteValueError`), the payload, and
        the decoder it went through: ``alloc(header)`` gives the buffer the payload is received
        into, or for a coded payload a decoder it is received through (`StreamDecoder`: the
        payload answered is then its ``out``, whose decoding the caller checks with ``finish``),
        and the value is hash-checked. ``alloc`` answering None (no room) raises `NoRoom`. A
        value that fails a check raises `RemoteValueError` after its buffer was handed out (the
        caller gives it back)."""
        conn = self._take()
        reusable = False
        try:
            value = _Value.ask(conn, name.encode(), expect)
            if value is None:
                reusable = True
                return None
            total = value.total
            first = bytearray(min(total, MAX_HEADER))
            value.read_into(memoryview(first))
            head = bytes(first)
            h = header_of(head, total)
            sink = alloc(h)
            if sink is None:
                raise NoRoom(f"no room in L1 for {h.nbytes} bytes")
            early = memoryview(head)[h.start :]
            hasher = value_hasher(head, h)
            if isinstance(sink, memoryview):
                dst, decoder = sink, None
                dst[: early.nbytes] = early
                value.read_into(dst[early.nbytes :])
                hasher.update(dst)
            else:
                dst, decoder = sink.out, sink
                _receive_decoding(value, sink, early, hasher)
            value.end()
            reusable = True
            check_digest(head, h, hasher.intdigest())
            return h, dst, decoder
        except TimeoutError:
            raise redis.TimeoutError("Timeout reading from Redis") from None
        except (redis.RedisError, RemoteValueError, NoRoom):
            raise
        except OSError as exc:
            raise redis.ConnectionError(f"error reading from Redis: {exc}") from None
        finally:
            self._put(conn, reusable)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    def _take(self) -> _Conn:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._connect()

    def _put(self, conn: _Conn, reusable: bool) -> None:
        if reusable and not conn.buf:
            with self._lock:
                if len(self._idle) < MAX_IDLE:
                    self._idle.append(conn)
                    return
        conn.close()

    def _connect(self) -> _Conn:
        p = self._params
        try:
            if p.get("path"):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self.timeout_s)
                sock.connect(p["path"])
            else:
                sock = socket.create_connection(
                    (p.get("host", "localhost"), int(p.get("port", 6379))), self.timeout_s
                )
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except TimeoutError:
            raise redis.TimeoutError("Timeout connecting to Redis") from None
        except OSError as exc:
            raise redis.ConnectionError(f"error connecting to Redis: {exc}") from None
        conn = _Conn(sock)
        try:
            if p.get("password") is not None:
                user = p.get("username")
                creds = [user.encode(), p["password"].encode()] if user else [p["password"].encode()]
                conn.send(b"AUTH", *creds)
                conn.simple()
            if int(p.get("db", 0) or 0):
                conn.send(b"SELECT", str(int(p["db"])).encode())
                conn.simple()
            conn.send(b"CLIENT", b"SETNAME", b"kvwarden")
            conn.simple()
        except TimeoutError:
            conn.close()
            raise redis.TimeoutError("Timeout connecting to Redis") from None
        except OSError as exc:
            conn.close()
            raise redis.ConnectionError(f"error connecting to Redis: {exc}") from None
        except BaseException:
            conn.close()
            raise
        return conn
