"""The kvwarden exception tree.

    KVWardenError
    ├── ProtocolError            a request that cannot be decoded or validated (wire edge)
    │   ├── FrameTooLarge        a frame over the size limit
    │   └── VersionMismatch      client and server speak different protocol versions
    ├── RequestError             a well-formed request the server refuses
    │   ├── NotRegistered        the instance id is not tracked
    │   ├── NotOwner             the instance is registered with another secret
    │   ├── LimitExceeded        a bound the server keeps (instances, pool bytes, ...) is reached
    │   └── InvalidLayout        a registered KV layout that cannot be mapped or used
    ├── ServerError              an unexpected failure inside a handler
    │   ├── ShuttingDown         the server is draining: it takes no new requests
    │   └── Unsupported          no handler for this message type on this server
    └── ClientError              raised only by `dataplane.client`
        ├── RequestTimeout       no reply within the request's timeout
        ├── RequestAborted       a transfer abandoned because the server went unhealthy
        └── ServerClosed         the adapter was closed

Every server-side error maps to an error reply ``{code, message}`` whose code is the class's
``code``; the client raises the matching class again from the reply.
"""

from __future__ import annotations


class KVWardenError(Exception):
    """Base of every kvwarden error."""

    code = "ERROR"


class ProtocolError(KVWardenError):
    """A frame that cannot be decoded or does not validate."""

    code = "BAD_REQUEST"


class FrameTooLarge(ProtocolError):
    code = "FRAME_TOO_LARGE"


class VersionMismatch(ProtocolError):
    code = "VERSION_MISMATCH"


class RequestError(KVWardenError):
    """A well-formed request that the server refuses."""

    code = "REQUEST_REFUSED"


class NotRegistered(RequestError):
    code = "NOT_REGISTERED"


class NotOwner(RequestError):
    """A request of an instance registered by someone else (its secret differs)."""

    code = "NOT_OWNER"


class LimitExceeded(RequestError):
    """A request that would take the server past one of its limits (named in the message;
    ``limit`` names it for metrics: a setting, or ``descriptors`` / ``segment_space``)."""

    code = "LIMIT_EXCEEDED"

    def __init__(self, message: str, limit: str = "other") -> None:
        super().__init__(message)
        self.limit = limit


class InvalidLayout(RequestError):
    code = "INVALID_LAYOUT"


class ServerError(KVWardenError):
    code = "INTERNAL"


class ShuttingDown(ServerError):
    code = "SHUTTING_DOWN"


class Unsupported(ServerError):
    code = "UNSUPPORTED"


class ClientError(KVWardenError):
    code = "CLIENT"


class RequestTimeout(ClientError):
    code = "TIMEOUT"


class RequestAborted(ClientError):
    code = "ABORTED"


class ServerClosed(ClientError):
    code = "CLOSED"


_BY_CODE: dict[str, type[KVWardenError]] = {
    cls.code: cls
    for cls in (
        ProtocolError,
        FrameTooLarge,
        VersionMismatch,
        RequestError,
        NotRegistered,
        NotOwner,
        LimitExceeded,
        InvalidLayout,
        ServerError,
        ShuttingDown,
        Unsupported,
    )
}


def error_from_reply(code: str, message: str) -> KVWardenError:
    """Rebuild the typed exception for an error reply (unknown codes become ServerError)."""
    cls = _BY_CODE.get(code, ServerError)
    err = cls(message)
    return err
