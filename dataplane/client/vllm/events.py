"""The vLLM connector and kvwarden's KV events: the names of a request's blocks that a store
carries (`engine_names`), and ``EventRelay``, which adds kvwarden's events to the engine's own
stream (the connector's ``take_events``), so a router that listens only to engines learns that
this engine can get a block from its kvwarden.

The relay subscribes (thread ``kvwarden-vllm-events``, start/stop/join) to the server's
``kv_events_endpoint`` under ``kvwarden.kv_events_topic`` and decodes each batch with vLLM's own
classes. It keeps at most ``MAX_EVENTS`` events between two ``take_events`` calls (one a
scheduler step); more are dropped, counted and logged once. A kvwarden serving several models
publishes every model's blocks: give it one topic per model, or one kvwarden per model, for the
relay to forward only this engine's.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import zmq

from dataplane.wire.blocks import EngineBlocks

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

MAX_EVENTS = 100_000
_POLL_MS = 100


def engine_names(request: Request, block_size: int) -> EngineBlocks | None:
    """vLLM's names of the request's full prompt blocks, as its own KV events give them (its
    block hashes, integers unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0, the adapter's name and
    the extra keys of each block), for kvwarden's events; None without block hashes."""
    from vllm.v1.core.kv_cache_utils import (
        generate_block_hash_extra_keys,
        maybe_convert_block_hash,
        to_event_extra_keys,
    )

    hashes = request.block_hashes
    if not hashes:
        return None
    lora = request.lora_request
    extra = None
    if lora is not None or request.cache_salt or request.mm_features or request.prompt_embeds is not None:
        keys, at = [], 0
        for i in range(len(hashes)):
            k, at = generate_block_hash_extra_keys(request, i * block_size, (i + 1) * block_size, at)
            keys.append(k)
        extra = to_event_extra_keys(keys)
    return EngineBlocks(
        block_size,
        tuple(maybe_convert_block_hash(h) for h in hashes),
        None if lora is None else lora.lora_name,
        None if extra is None else tuple(None if e is None else tuple(e) for e in extra),
    )


class EventRelay:
    """``_lock`` guards ``_events`` and ``dropped``."""

    def __init__(self, endpoint: str, topic: str = "", max_events: int = MAX_EVENTS) -> None:
        self.endpoint = endpoint
        self.topic = topic.encode()
        self.max_events = max_events
        self._lock = threading.Lock()
        self._events: list[KVCacheEvent] = []
        self.dropped = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvwarden-vllm-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout_s: float = 5.0) -> bool:
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def take(self) -> list[KVCacheEvent]:
        with self._lock:
            out, self._events = self._events, []
        return out

    def _run(self) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        dec = msgspec.msgpack.Decoder(type=KVEventBatch)
        ctx: zmq.Context[Any] = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        warned = False
        try:
            while not self._stop.is_set():
                if not sub.poll(_POLL_MS):
                    continue
                frames = sub.recv_multipart()
                try:
                    batch = dec.decode(frames[-1])
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    logger.warning("kvwarden: an event batch could not be decoded: %s", exc)
                    continue
                with self._lock:
                    room = self.max_events - len(self._events)
                    self._events.extend(batch.events[: max(room, 0)])
                    lost = max(0, len(batch.events) - max(room, 0))
                    self.dropped += lost
                if lost and not warned:
                    warned = True
                    logger.warning("kvwarden: events not taken in time: %d dropped (more not logged)", lost)
        finally:
            sub.close(0)
            ctx.term()
