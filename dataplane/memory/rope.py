"""Rotary position embeddings (RoPE), and moving cached keys from one position to another.

A key computed at position ``p`` is ``R(p) k``: each pair of its first ``rotary_dim`` features is
rotated by the angle ``(p / scaling) * inv_freq[i]``. Rotations compose, so the key of the same
token at position ``q`` is ``R(q - p) R(p) k``: re-rotating a cached chunk by the offset
``q - p`` is what reusing it at another position needs, without the model. Values carry no
position and never change. Pairs are NeoX-style (feature ``i`` with ``i + rotary_dim / 2``) or
interleaved (``2i`` with ``2i + 1``); features past ``rotary_dim`` are left as they are.

``RopeParams`` checks a model's parameters (a ValueError naming the one that is wrong);
``RopeTables`` holds one model's cos/sin of every offset up to ``max_positions``, built once
(kept per instance by the blend module).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

STYLES = ("neox", "interleaved")
MAX_POSITIONS = 1 << 17  # tables of 2 x 131,072 x rotary_dim / 2 float32: 64 MiB at rotary_dim 128
MAX_ROTARY_DIM = 1024


@dataclass(frozen=True)
class RopeParams:
    rotary_dim: int
    base: float
    style: str
    scaling: float  # linear position scaling (positions divided by it); 1 = none
    max_positions: int

    def check(self, head_dim: int) -> RopeParams:
        """Self, or ValueError naming the parameter that is wrong."""
        rd = self.rotary_dim
        if isinstance(rd, bool) or not isinstance(rd, int) or rd <= 0 or rd % 2:
            raise ValueError(f"rotary_dim: {rd!r} must be a positive even integer")
        if rd > min(head_dim, MAX_ROTARY_DIM):
            raise ValueError(f"rotary_dim: {rd} exceeds the head dim {head_dim}")
        for name in ("base", "scaling"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name}: {v!r} must be a finite number > 0")
        if self.style not in STYLES:
            raise ValueError(f"style: {self.style!r} must be one of {', '.join(STYLES)}")
        mp = self.max_positions
        if isinstance(mp, bool) or not isinstance(mp, int) or not 1 <= mp <= MAX_POSITIONS:
            raise ValueError(f"max_positions: {mp!r} must be an integer in [1, {MAX_POSITIONS}]")
        return self

    def check_span(self, position: int, n_tokens: int) -> None:
        """ValueError when ``n_tokens`` from ``position`` on pass ``max_positions``."""
        end = position + n_tokens
        if end > self.max_positions:
            raise ValueError(
                f"position: chunks up to position {end} exceed the registered max_positions "
                f"{self.max_positions}"
            )

    def inv_freq(self) -> torch.Tensor:
        exps = torch.arange(0, self.rotary_dim, 2, dtype=torch.float64) / self.rotary_dim
        return 1.0 / (float(self.base) ** exps)


def _pairs(x: torch.Tensor, style: str, rd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two halves of each rotated pair (views into ``x``)."""
    if style == "neox":
        return x[..., : rd // 2], x[..., rd // 2 : rd]
    return x[..., 0:rd:2], x[..., 1:rd:2]


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str, rd: int) -> torch.Tensor:
    """Rotate each pair of ``x`` ([..., head_dim]) in place by the angle whose cos and sin are
    given ([..., rd / 2], broadcast); the arithmetic in float32, one rounding back to ``x``'s
    dtype. Returns ``x``."""
    a, b = _pairs(x, style, rd)
    af, bf = a.float(), b.float()  # (views when x is float32: both results are made first)
    na = af * cos
    na.addcmul_(bf, sin, value=-1.0)
    nb = bf * cos
    nb.addcmul_(af, sin)
    a.copy_(na)
    b.copy_(nb)
    return x


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str, rd: int) -> torch.Tensor:
    """`rotate_` on a copy: the caller's tensor is never changed."""
    return rotate_(x.clone(), cos, sin, style, rd)


def rope_at(x: torch.Tensor, positions: torch.Tensor, p: RopeParams) -> torch.Tensor:
    """RoPE applied directly: ``x`` [tokens, heads, head_dim] at ``positions`` [tokens] (the
    model's own computation, the reference the re-rotation is checked against)."""
    ang = (positions.to(torch.float64)[:, None] / p.scaling) * p.inv_freq()[None, :]
    cos, sin = ang.cos().to(torch.float32)[:, None, :], ang.sin().to(torch.float32)[:, None, :]
    return rotate(x, cos, sin, p.style, p.rotary_dim)


class RopeTables:
    """cos and sin of every offset in [0, max_positions) for one model (float32)."""

    def __init__(self, params: RopeParams) -> None:
        self.params = params
        offsets = torch.arange(params.max_positions, dtype=torch.float64)
        ang = (offsets[:, None] / params.scaling) * params.inv_freq()[None, :]
        self.cos = ang.cos().to(torch.float32)
        self.sin = ang.sin().to(torch.float32)

    @property
    def nbytes(self) -> int:
        return self.cos.numel() * 4 * 2

    def shift(self, keys: torch.Tensor, offset: int) -> torch.Tensor:
        """Keys ([..., head_dim], computed at some positions) as they are ``offset`` positions
        later (earlier, when negative), as a new tensor. ValueError past ``max_positions``."""
        return self.shift_(keys.clone(), offset)

    def shift_(self, keys: torch.Tensor, offset: int) -> torch.Tensor:
        """`shift` in place (the chunk buffers of a blend transfer); returns ``keys``."""
        if offset == 0:
            self._index(offset)
            return keys
        cos, sin = self._angle(offset)
        if cos.device != keys.device:  # (CUDA keys: the rotation runs where they are)
            cos, sin = cos.to(keys.device), sin.to(keys.device)
        return rotate_(keys, cos, sin, self.params.style, self.params.rotary_dim)

    def angle(self, offset: int) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin ([rotary_dim / 2] float32 arrays) of the rotation by ``offset`` positions."""
        cos, sin = self._angle(offset)
        return cos.numpy(), sin.numpy()

    def _angle(self, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self._index(offset)
        return self.cos[n], (self.sin[n] if offset >= 0 else -self.sin[n])

    def _index(self, offset: int) -> int:
        n = abs(offset)
        if n >= self.params.max_positions:
            raise ValueError(f"position offset {offset} is beyond max_positions {self.params.max_positions}")
        return n
