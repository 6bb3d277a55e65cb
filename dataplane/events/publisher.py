"""The KV-event publisher: thread ``kvwarden-kv-events`` turns the sink's reports into vLLM
``EventBatch`` es on a ZMQ PUB socket, and answers replay requests on a ROUTER socket.

Both sockets belong to the thread (bound by ``bind`` on the caller's, so a bad endpoint fails
the start). Every `PUBLISH_EVERY_S` the thread publishes what the sink has queued, in batches
of at most ``MAX_BATCH_EVENTS``; sequence numbers start at 0 with each process, whose first batch is
``AllBlocksCleared`` (what an earlier process on this endpoint announced is void). The PUB
socket drops what a subscriber past its high-water mark cannot take, so a slow or absent
subscriber never slows the thread, let alone a STORE; it asks the replay socket for what it
missed, from the last ``buffer_batches`` batches.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from dataplane.events import vllm_format as fmt
from dataplane.events.ledger import Ledger
from dataplane.events.sink import EventSink

logger = logging.getLogger(__name__)

MAX_BATCH_EVENTS = 1024
PUBLISH_EVERY_S = 0.005  # how often the thread collects the sink's reports and replay requests
MAX_REPLAY_REQUESTS = 16  # served per wake: a flood of them never starves publishing


@dataclass(frozen=True, slots=True)
class EventsState:
    """What `/metrics` shows of the events (`KVEventPublisher.state`)."""

    endpoint: str
    replay_endpoint: str | None
    alive: bool
    batches: int
    stored: int
    removed: int
    cleared: int
    replays: int
    dropped: int  # reports that did not fit the queue
    queued: int
    held: int  # chunks announced and not withdrawn


@dataclass
class EventCounts:
    batches: int = 0
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    replays: int = 0


def binds(endpoint: str) -> bool:
    """vLLM's rule: wildcard, ipc and inproc endpoints are bound, the rest connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    def __init__(
        self,
        sink: EventSink,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_batches: int = 10_000,
        hwm: int = 100_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.sink = sink
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.hwm = hwm
        self.clock = clock
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._ledger = Ledger()
        self._seq = 0
        self._dropped_seen = 0
        self.counts = EventCounts()  # written by the thread; read as a snapshot (ints)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pub: zmq.Socket[Any] | None = None
        self._replay: zmq.Socket[Any] | None = None
        self.bound: tuple[str, str | None] = (endpoint, replay_endpoint)

    # ------------------------------------------------------------ lifecycle
    def bind(self) -> None:
        """Open the sockets (ValueError naming the setting whose endpoint cannot be used)."""
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        replay = None
        what, where = "kv_events_endpoint", self.endpoint
        try:
            pub.bind(self.endpoint) if binds(self.endpoint) else pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                what, where = "kv_events_replay_endpoint", self.replay_endpoint
                replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            pub.close(0)
            if replay is not None:
                replay.close(0)
            raise ValueError(f"{what} {where}: {exc}") from None
        self.bound = (
            pub.getsockopt_string(zmq.LAST_ENDPOINT) or self.endpoint,
            None if replay is None else replay.getsockopt_string(zmq.LAST_ENDPOINT),
        )
        self._pub, self._replay = pub, replay

    def start(self) -> None:
        if self._pub is None:
            self.bind()
        self._thread = threading.Thread(target=self._run, name="kvwarden-kv-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout_s: float = 5.0) -> bool:
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # --------------------------------------------------------------- thread
    def _run(self) -> None:
        assert self._pub is not None
        try:
            self._send([self._ledger.cleared()])
            while not self._stop.wait(PUBLISH_EVERY_S):
                self._serve_replays()
                while not self._stop.is_set():
                    events = self._drain()
                    if events is None:
                        break
                    if events:
                        self._send(events)
            while (events := self._drain()) is not None:  # what was reported before the stop
                if events:
                    self._send(events)
        finally:
            self._pub.close(0)
            if self._replay is not None:
                self._replay.close(0)

    def _drain(self) -> list[dict[str, Any]] | None:
        """The events of the next reports (None: none queued)."""
        items = self.sink.take(MAX_BATCH_EVENTS)
        if not items:
            return None
        events: list[dict[str, Any]] = []
        led = self._ledger
        for item in items:
            kind = item[0]
            if kind == "describe":
                led.describe(item[1], item[2])
            elif kind == "stored":
                ev = led.stored(item[1], item[2])
                if ev is not None:
                    events.append(ev)
            elif kind == "removed":
                ev = led.removed(item[1], item[2])
                if ev is not None:
                    events.append(ev)
            elif kind == "removed_all":
                events.extend(led.removed_all(item[1]))
            else:  # "cleared", "overflow": whatever was said before is void
                if kind == "overflow":
                    logger.warning("kv events: the queue overflowed: subscribers are told AllBlocksCleared")
                events.append(led.cleared())
        return events

    def _send(self, events: list[dict[str, Any]]) -> None:
        assert self._pub is not None
        payload = fmt.batch(self.clock(), events)
        seq = fmt.seq_bytes(self._seq)
        with contextlib.suppress(zmq.Again):  # (a connected PUB may have no peer yet: replay has it)
            self._pub.send_multipart((self.topic, seq, payload), flags=zmq.NOBLOCK)
        self._buffer.append((self._seq, payload))
        self._seq += 1
        c = self.counts
        c.batches += 1
        for ev in events:
            t = ev["type"]
            if t == "BlockStored":
                c.stored += 1
            elif t == "BlockRemoved":
                c.removed += 1
            else:
                c.cleared += 1

    def _serve_replays(self) -> None:
        sock = self._replay
        if sock is None:
            return
        for _ in range(MAX_REPLAY_REQUESTS):
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("kv events: a replay request of %d frames ignored", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            self.counts.replays += 1
            try:
                for seq, payload in self._buffer:
                    if seq >= first:
                        sock.send_multipart(
                            (client, b"", self.topic, fmt.seq_bytes(seq), payload), zmq.NOBLOCK
                        )
                sock.send_multipart((client, b"", b"", fmt.END_SEQ, b""), zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # (the requester went away, or its pipe is full)
                logger.warning("kv events: a replay was cut short: %s", exc)

    def state(self) -> EventsState:
        c = self.counts  # (ints the thread writes: a snapshot, each read whole)
        return EventsState(
            *self.bound,
            self.alive(),
            c.batches,
            c.stored,
            c.removed,
            c.cleared,
            c.replays,
            self.sink.dropped,
            self.sink.depth(),
            len(self._ledger),
        )

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
