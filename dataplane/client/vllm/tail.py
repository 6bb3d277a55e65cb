"""A prompt's tail: the tokens past its last full chunk, up to those vLLM always computes itself
(``Planner.tail``), stored as a chunk of their own so a decode engine given a disaggregated
prefill's handoff computes none of the prompt but them (a kv_producer's opt-in,
``kvwarden.store_tail``).

A tail chunk is keyed like any chunk, on the prompt's tokens before it and its own tokens, but
its tokens are followed by ``TAIL_MARK`` up to the chunk size: no prompt holds that token (vLLM's
token ids are not negative), so a tail's key never names a full chunk, nor another length's
tail, and only a request with exactly that prompt (and key context) finds it. The server needs
no notion of it: in every tier it is a chunk like the others.

Its bytes are whole blocks, as every chunk of a block-major format (vLLM's CPU backend) is: the
blocks holding the tail, then the last of them again to the chunk's end. A load writes the
blocks holding the tail and leaves the rest alone (block id -1). The last block's positions
past the prompt hold whatever the producer's block held there (vLLM does not clear a block it
reuses), as they do in vLLM's own disaggregated transfers: a decode engine never attends to a
position past its sequence, and overwrites them as it decodes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dataplane.wire.kinds import KVFormat

TAIL_MARK = -1  # fills a tail chunk past its tokens: never a prompt's token


def tail_end(n_prompt: int, keep: int, chunk_size: int) -> int:
    """The prompt tokens a tail chunk ends at: all but the ``keep`` last ones (vLLM computes
    those); 0 when they end on a chunk boundary (full chunks cover them)."""
    end = n_prompt - keep
    return end if end > 0 and end % chunk_size else 0


def padded(tokens: np.ndarray, end: int, chunk_size: int) -> np.ndarray:
    """``tokens[:end]``, then ``TAIL_MARK`` up to the next chunk boundary: what keys the prefix
    and its tail chunk."""
    out = np.full(-(-end // chunk_size) * chunk_size, TAIL_MARK, dtype=np.int64)
    out[:end] = tokens[:end]
    return out


def real_length(tokens: np.ndarray) -> int:
    """The tokens of ``tokens`` before a tail's marks (all of them when it ends in none)."""
    if not len(tokens) or tokens[-1] != TAIL_MARK:
        return len(tokens)
    return len(tokens) - int(np.count_nonzero(tokens == TAIL_MARK))  # (marks only ever trail)


def tail_blocks(blocks: np.ndarray, end: int, chunk_size: int, block_size: int, store: bool) -> np.ndarray:
    """The blocks of the first ``end`` tokens, then, to the chunk boundary, the last of them
    again (``store``: read twice, never written) or -1 (a load: left alone)."""
    held = np.asarray(blocks[: -(-end // block_size)], dtype=np.int64)
    more = -(-end // chunk_size) * chunk_size // block_size - len(held)
    fill = held[-1] if store else -1
    return np.concatenate([held, np.full(more, fill, dtype=np.int64)])


def tail_refusal(kv_format: KVFormat, windowed: bool, settings: dict[str, Any]) -> str | None:
    """Why an engine's transfers cannot move a tail chunk (None: they can). It moves as whole
    blocks written by the worker itself, which leaves the blocks past the prompt alone: a
    block-major format (vLLM's CPU backend), engine-driven, one KV cache group, no window."""
    if kv_format is KVFormat.TOKEN_MAJOR:
        return (
            "a tail chunk moves in whole blocks of vLLM's CPU backend alone (this engine's KV is token-major)"
        )
    if settings["kvwarden.transfer_mode"] == "server_driven":
        return "a tail chunk is moved by engine-driven transfers alone (transfer_mode is server_driven)"
    if windowed:
        return "a model with sliding windows or several KV cache groups moves no tail chunk"
    return None
