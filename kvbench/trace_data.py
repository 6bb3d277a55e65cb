"""TraceRequest traces for `kvwarden bench trace`: the Mooncake format read from a file, and a generator.

A trace is JSON lines, one request each (the Mooncake traces' format, FAST'25 release)::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ...]}

``timestamp`` in ms from the trace's start; ``hash_ids`` chained prefix-block ids: block i's id
names the whole prefix up to its end, ``BLOCK_TOKENS`` tokens a block, the last one partial
(``input_length`` says how much of it). Token ids are derived from the ids deterministically
(`block_tokens`), so two requests sharing a prefix of ids share those tokens, and a replay
through a real server finds exactly the prefixes the trace shares.

`generate` makes traces of the same format for users without one; its knobs (`TraceShape`):

- ``conversations``: multi-turn chats; each turn repeats the whole conversation so far (its
  ids) and adds the user's new message and the last answer (``turn_blocks`` new blocks);
  ``turns`` turns each, ``think_ms`` apart;
- ``system_prompts`` shared system prompts of ``system_blocks`` blocks; each conversation and
  one-off request starts with one of them, chosen with a Zipf skew (``zipf``);
- ``one_off``: the share of requests that are single questions on a fresh document of
  ``doc_blocks`` blocks after a system prompt, never asked again;
- requests arrive ``gap_ms`` apart on average (exponential), turns of a conversation
  interleaved with everything else.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake traces
VOCAB = 32_000


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def full_blocks(self) -> int:
        """Blocks of ``BLOCK_TOKENS`` the prompt fills (a server stores only whole chunks)."""
        return min(len(self.hash_ids), self.input_length // BLOCK_TOKENS)


def load(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """The requests of a trace file; ValueError naming the line and the problem."""
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(out) >= limit:
                break
            out.append(_request(line, f"{path}:{n}"))
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


def _request(line: str, where: str) -> TraceRequest:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a request is a JSON object")
    ids = row.get("hash_ids")
    ts, il, ol = row.get("timestamp", 0), row.get("input_length"), row.get("output_length", 0)
    for name, v in (("timestamp", ts), ("input_length", il), ("output_length", ol)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{where}: {name} must be an integer >= 0, got {v!r}")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
        raise ValueError(f"{where}: hash_ids must be a non-empty list of integers >= 0")
    assert isinstance(il, int)
    if not (len(ids) - 1) * BLOCK_TOKENS < il <= len(ids) * BLOCK_TOKENS:
        raise ValueError(
            f"{where}: input_length {il} does not fit {len(ids)} blocks of {BLOCK_TOKENS} tokens"
        )
    return TraceRequest(int(ts), il, int(ol), tuple(ids))


def block_tokens(block_id: int) -> np.ndarray:
    """The ``BLOCK_TOKENS`` token ids of block ``block_id`` (the same every time)."""
    return np.random.default_rng(block_id).integers(1, VOCAB, BLOCK_TOKENS, dtype=np.int64)


def prompt_tokens(r: TraceRequest) -> np.ndarray:
    """The token ids of ``r``'s prompt (``input_length`` of them)."""
    return np.concatenate([block_tokens(b) for b in r.hash_ids])[: r.input_length]


def dump(reqs: list[TraceRequest], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in reqs:
            row = {
                "timestamp": r.timestamp_ms,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }
            f.write(json.dumps(row) + "\n")


@dataclass(frozen=True)
class TraceShape:
    """The generator's knobs (see the module's docstring)."""

    requests: int = 2_000
    conversations: int = 150
    turns: int = 6
    turn_blocks: int = 2
    think_ms: int = 30_000
    system_prompts: int = 8
    system_blocks: int = 4
    zipf: float = 1.2
    one_off: float = 0.4
    doc_blocks: int = 8
    gap_ms: float = 200.0
    seed: int = 0


def generate(shape: TraceShape) -> list[TraceRequest]:
    """A trace of ``shape.requests`` requests (see the module's docstring)."""
    rng = np.random.default_rng(shape.seed)
    ids = iter(range(1, 1 << 62))
    systems = [[next(ids) for _ in range(shape.system_blocks)] for _ in range(max(1, shape.system_prompts))]
    weights = 1.0 / np.arange(1, len(systems) + 1) ** shape.zipf
    weights /= weights.sum()
    events: list[tuple[float, list[int]]] = []
    n_turns = min(shape.requests - int(shape.requests * shape.one_off), shape.conversations * shape.turns)
    per_conv = max(1, shape.turns)
    t = 0.0
    for c in range(shape.conversations):
        start = t + rng.exponential(shape.gap_ms * per_conv)
        t = start
        history = list(systems[rng.choice(len(systems), p=weights)])
        for turn in range(per_conv):
            if c * per_conv + turn >= n_turns:
                break
            history = history + [next(ids) for _ in range(max(1, shape.turn_blocks))]
            events.append((start + turn * shape.think_ms * rng.uniform(0.5, 1.5), list(history)))
    horizon = max((e[0] for e in events), default=shape.requests * shape.gap_ms)
    for _ in range(max(0, shape.requests - len(events))):
        doc = list(systems[rng.choice(len(systems), p=weights)]) + [
            next(ids) for _ in range(shape.doc_blocks)
        ]
        events.append((rng.uniform(0, horizon), doc))
    events.sort(key=lambda e: e[0])
    out = []
    for ts, blocks in events[: shape.requests]:
        tail = int(rng.integers(1, BLOCK_TOKENS + 1))  # the last block is partial
        il = (len(blocks) - 1) * BLOCK_TOKENS + tail
        out.append(TraceRequest(int(ts), il, int(rng.integers(1, 1024)), tuple(blocks)))
    return out


def unique_full_blocks(reqs: list[TraceRequest]) -> int:
    return len({b for r in reqs for b in r.hash_ids[: r.full_blocks]})


def iter_full(reqs: list[TraceRequest]) -> Iterator[tuple[int, ...]]:
    for r in reqs:
        yield r.hash_ids[: r.full_blocks]
