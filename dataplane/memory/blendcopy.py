"""Moving one chunk for a blend transfer: keys rotated by a position offset, values untouched.

A `Side` is one end of the move: per layer, its K and V as ``[rows, heads * head_dim]`` and
the rows the chunk's tokens occupy (a chunk buffer: rows 0..n; a worker's mapped cache: its
token slots). `move` reads each layer's rows, rotates the keys and writes them to the other
side in one pass (`dataplane.memory.rope_kernel`, the layers split across the copy threads),
when the kernels are compiled and the memory is the CPU's in bfloat16 or float32. Otherwise
the chunk is copied into a private buffer (`Side.work`) first and its keys rotated there with
torch, layer by layer while they are in cache, before it is written to the destination.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dataplane.memory import rope_kernel
from dataplane.memory.copies import CopySplitter
from dataplane.memory.kvmemory import MappedKV
from dataplane.memory.rope import RopeTables

_CPU = torch.device("cpu")


@dataclass(frozen=True)
class Geometry:
    dtype: torch.dtype
    num_layers: int
    tokens: int  # the chunk size
    heads: int
    head_dim: int

    @property
    def row(self) -> int:
        return self.heads * self.head_dim


@dataclass(frozen=True)
class Side:
    halves: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # layer -> (K, V) [rows, row]
    rows: np.ndarray  # int64, one per token of the chunk
    buf: torch.Tensor | None = None  # a chunk buffer's bytes (None: a worker's mapped cache)
    device: torch.device = _CPU  # where its memory is

    @property
    def fast(self) -> bool:
        k, _ = self.halves(0)
        return rope_kernel.supported(k)


def chunk_side(buf: torch.Tensor, g: Geometry) -> Side:
    """A chunk buffer ([layers, 2, tokens, row] of ``g.dtype``, as bytes)."""
    view = buf.view(g.dtype).view(g.num_layers, 2, g.tokens, g.row)
    return Side(lambda layer: (view[layer, 0], view[layer, 1]), np.arange(g.tokens, dtype=np.int64), buf)


def cache_side(kv: MappedKV, slots: np.ndarray) -> Side:
    """A worker's mapped cache, the chunk's tokens at ``slots``."""

    def halves(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = kv.stacked[layer] if kv.stacked is not None else kv.layers[layer]
        return t[0], t[1]

    return Side(halves, np.ascontiguousarray(slots, dtype=np.int64), device=kv.device)


def keys_of(buf: torch.Tensor, g: Geometry) -> torch.Tensor:
    """The K half of a chunk buffer, [layers, tokens, heads, head_dim]."""
    return buf.view(g.dtype).view(g.num_layers, 2, g.tokens, g.heads, g.head_dim)[:, 0]


def shift_keys(tables: RopeTables, keys: torch.Tensor, offset: int, splitter: CopySplitter | None) -> None:
    """Rotate a chunk's keys ([layers, ...]) in place with torch, a layer at a time (in cache),
    the layers split across the copy threads."""

    def part(lo: int, hi: int) -> None:
        for layer in range(lo, hi):
            tables.shift_(keys[layer], offset)

    if splitter is None or keys.device.type != "cpu":
        part(0, keys.shape[0])
    else:
        splitter.run(part, keys.shape[0])


def move(
    tables: RopeTables,
    src: Side,
    dst: Side,
    offset: int,
    g: Geometry,
    splitter: CopySplitter | None,
    kernels_ready: bool,
    fill: Callable[[torch.Tensor], object],
    drain: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """One chunk from ``src`` to ``dst``, keys rotated by ``offset`` positions. Without the
    kernels: ``fill(work)`` copies the chunk's bytes into ``work`` (``dst``'s buffer when it has
    one, else a private one on ``dst``'s device: a CUDA worker's keys are rotated on its GPU),
    the keys are rotated there, and ``drain(work)`` writes a private buffer to ``dst``."""
    if kernels_ready and src.fast and dst.fast:
        _move_fast(tables, src, dst, offset, g, splitter)
        return
    nbytes = g.num_layers * 2 * g.tokens * g.row * _item(g)
    work = dst.buf if dst.buf is not None else torch.empty(nbytes, dtype=torch.uint8, device=dst.device)
    fill(work)
    shift_keys(tables, keys_of(work, g), offset, splitter)
    if dst.buf is None:
        assert drain is not None
        drain(work)


def _item(g: Geometry) -> int:
    return torch.empty((), dtype=g.dtype).element_size()


def _move_fast(
    tables: RopeTables, src: Side, dst: Side, offset: int, g: Geometry, splitter: CopySplitter | None
) -> None:
    cos, sin = tables.angle(offset)
    p = tables.params
    neox = p.style == "neox"

    def part(lo: int, hi: int) -> None:
        for layer in range(lo, hi):
            sk, sv = src.halves(layer)
            dk, dv = dst.halves(layer)
            rope_kernel.rotate_rows(
                sk, src.rows, dk, dst.rows, cos, sin, g.heads, g.head_dim, p.rotary_dim, neox
            )
            rope_kernel.copy_rows(sv, src.rows, dv, dst.rows)

    if splitter is None:
        part(0, g.num_layers)
    else:
        splitter.run(part, g.num_layers)
