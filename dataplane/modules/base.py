"""What a module gives the server (its handlers and lifecycle) and what it is given.

A module never sees the server loop: it gets the values it needs (`ServerInfo`) at
construction, and the assembler (`dataplane.server.runtime`) subscribes its callbacks (the
management module's connection events) to the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from dataplane.wire.messages import MsgType
from dataplane.wire.replies import ServerHello


@dataclass(frozen=True, slots=True)
class RequestContext:
    request_id: int
    type: MsgType
    conn_fd: int  # the TCP/IPC connection the request came over (-1 unknown)
    inline: bool = False  # answered on the loop thread (`Handler.inline`): it must never wait
    # run once the reply is on its way (its frame queued to be sent): work the request started
    # that its answer need not wait for. Each must be quick and never wait (it may queue work).
    after: list[Callable[[], None]] = field(default_factory=list)


class Deferred(Exception):
    """Raised by a handler answering inline that finds it would have to wait after all (for the
    remote tier, say): it has changed nothing, and the loop hands the request to its pool."""


HandlerFn = Callable[[RequestContext, Any], Any]  # returns the reply record of its table row


@dataclass(frozen=True, slots=True)
class Handler:
    """A module's function for one message type; where it runs, and what it must return, is
    the type's row in `dataplane.wire.table`."""

    fn: HandlerFn
    # TRANSFER rows (all of them): requests with the same key run in arrival order
    order_key: Callable[[Any], int] | None = None
    # TRANSFER rows declared inline: True for a request that will not wait and is cheap: the loop answers
    # it itself when no earlier request with its key is waiting or running (two thread
    # hand-offs less, ~0.3-0.5 ms of a round trip on a busy 2-core host); called with
    # ``rctx.inline`` set, the handler may still raise `Deferred` to run on the pool instead
    inline: Callable[[Any], bool] | None = None


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """Who this server is: what HELLO answers and `/status` shows (fixed for its lifetime)."""

    server_id: str
    boot_token: int  # random per start: a client that sees it change re-registers
    version: str
    protocol_version: int
    started_at: float  # wall clock (time.time())
    endpoint: str  # the bound ZMQ endpoint
    chunk_size: int
    max_frame_bytes: int

    def hello_body(self) -> ServerHello:
        """What HELLO and GET_SERVER_INFO answer: everything but the start time and endpoint."""
        return ServerHello(
            self.server_id,
            self.boot_token,
            self.version,
            self.protocol_version,
            self.chunk_size,
            self.max_frame_bytes,
        )


class Module(Protocol):
    name: str

    def handlers(self) -> dict[MsgType, Handler]: ...

    def start(self) -> None: ...

    def stop(self) -> None:
        """Stop and join background threads (the server still serves)."""

    def close(self) -> None:
        """Release all state; called after the loop and every background thread stopped."""
