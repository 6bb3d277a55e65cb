"""`Sidecar`: the HTTP app served by uvicorn on a thread of the data-plane process.

The main thread owns the signals (``kvwarden serve`` turns SIGTERM/SIGINT into an orderly stop),
so uvicorn must install none. The listening socket is bound in ``start()`` itself: a port in use
fails the start at once, with the address in the message, instead of killing a thread.
Lifecycle: ``start()`` returns once uvicorn serves (bounded wait); ``stop()`` asks it to exit
(in-flight requests get a bounded grace), then joins the thread with a bound.

Connections are bounded in number and in idle time, so idle clients cannot pile up descriptors
the data plane needs: beyond ``http_max_connections`` open connections a request is answered 503
and its connection closed (uvicorn's ``limit_concurrency``), and a connection must send a whole
request head within ``KEEP_ALIVE_S`` of opening or of its previous response, else it is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.main import create_app
from dataplane.server.facade import DataPlaneView

logger = logging.getLogger(__name__)

# uvicorn's keep-alive timeout (its default); here also the deadline of a request head
KEEP_ALIVE_S = 5


class _ThreadServer(uvicorn.Server):
    """A uvicorn server that leaves the process's signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29 calls this instead
        return None


class _HeadDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's HTTP protocol, with the keep-alive timer also armed when a connection opens, and
    kept (not cancelled by the first bytes) until a whole request head has arrived. uvicorn arms
    it only after a response, so a connection that never sends a request, or sends one a byte
    at a time, would otherwise hold its descriptor for ever."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def data_received(self, data: bytes) -> None:
        deadline, self.timeout_keep_alive_task = self.timeout_keep_alive_task, None
        cycle = self.cycle
        super().data_received(data)
        if deadline is None:
            return
        if self.cycle is cycle and self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = deadline  # no new request head yet: the deadline stands
        else:
            deadline.cancel()


class SidecarStartError(RuntimeError):
    """The sidecar could not start serving (the message says where and why)."""


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio sets TCP_NODELAY only on sockets that say so, and without it
    # a response's body waits behind its headers for the peer's delayed ACK (~40 ms)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


class Sidecar:
    def __init__(
        self,
        dp: DataPlaneView,
        host: str | None = None,
        port: int | None = None,
        app: FastAPI | None = None,
        graceful_timeout_s: float = 3.0,
        max_connections: int | None = None,
    ) -> None:
        self.dp = dp
        self.host = host if host is not None else dp.settings.http_host
        self.port = port if port is not None else dp.settings.http_port  # 0: any free port
        self.max_connections = (
            max_connections if max_connections is not None else dp.settings.http_max_connections
        )
        self.app = app if app is not None else create_app(dp)
        self._graceful_timeout_s = graceful_timeout_s
        self._sock: socket.socket | None = None
        self._server: _ThreadServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        if self._thread is not None:
            raise RuntimeError("sidecar already started")
        try:
            sock = _listen(self.host, self.port)
        except OSError as exc:
            raise SidecarStartError(f"cannot listen on {self.url}: {exc.strerror}") from exc
        self._sock = sock
        self.port = int(sock.getsockname()[1])
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            log_config=None,  # keep the process's logging set-up
            access_log=False,
            timeout_graceful_shutdown=int(max(1, self._graceful_timeout_s)),
            http=_HeadDeadlineProtocol,
            limit_concurrency=self.max_connections,
            timeout_keep_alive=KEEP_ALIVE_S,
            # asyncio tries this many accepts per wake-up; out of descriptors, each failure logs
            # and schedules a retry: a small number keeps that storm small
            backlog=64,
        )
        server = _ThreadServer(config)
        self._server = server
        self._thread = threading.Thread(
            target=self._run, args=(server, sock), name="kvwarden-http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        tick = threading.Event()
        while not server.started:
            if not self._thread.is_alive():
                self._close_socket()
                raise SidecarStartError(f"the HTTP server on {self.url} stopped during start-up")
            if time.monotonic() > deadline:
                self.stop()
                raise SidecarStartError(f"the HTTP server on {self.url} did not start in {timeout_s:g}s")
            tick.wait(0.005)
        logger.info(
            "sidecar: serving on %s (at most %d connections, idle ones closed after %d s)",
            self.url,
            self.max_connections,
            KEEP_ALIVE_S,
        )

    def _run(self, server: _ThreadServer, sock: socket.socket) -> None:
        try:
            server.run(sockets=[sock])
        except BaseException:  # SystemExit from uvicorn included: log it, never kill the process
            logger.exception("sidecar: HTTP server thread died")
        finally:
            self._close_socket()  # here, once uvicorn let go of it (stop() may have given up)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float | None = None) -> bool:
        """Stop serving; True when the thread ended within the bound."""
        server, thread = self._server, self._thread
        if server is None or thread is None:
            self._close_socket()
            return True
        server.should_exit = True
        bound = (self._graceful_timeout_s + 2.0) if timeout_s is None else timeout_s
        thread.join(bound)
        if thread.is_alive():
            server.force_exit = True
            thread.join(1.0)
        if thread.is_alive():
            # the socket stays open: uvicorn still holds it, and the thread closes it on its way out
            logger.error("sidecar: HTTP thread still alive %.1fs after stop", bound + 1.0)
            return False
        self._close_socket()
        logger.info("sidecar: stopped")
        return True

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
