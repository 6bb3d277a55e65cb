"""An entry of the remote tier's write-behind queue (`backend.RemoteBackend.put`): what the
writer sends, and its release (``done``: the caller's bytes may change once it is called)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class RedisWrite:
    key: bytes
    dtype: str
    shape: tuple[int, ...]
    payload: memoryview
    done: Callable[[], None] | None
    trial: bool = False  # let through while out of space, to try whether Redis has room again
    scope: bytes = b""  # named in it (`RemoteBackend.redis_key`)
    words: str | None = None  # the dtype of the chunk's elements (what `compress` may code)

    def release(self) -> None:
        """The writer is done with ``payload`` (sent, failed or dropped): called exactly once."""
        if self.done is not None:
            self.done()
