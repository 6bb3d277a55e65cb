"""Lossy int8 chunks (``kv_compression = int8``): a chunk of 16- or 32-bit float KV quantized to
one byte an element, about half the bytes in every tier.

As KIVI does: keys are quantized per channel (one minimum and one step for each channel of a
layer, over the chunk's tokens: a key's outlier channels keep their own range), values per token
(one for each token of a layer, over its heads and channels). A latent (multi-head latent
attention) is quantized per channel, like a key. Each element becomes
``round((x - min) / step)`` in 0..255, asymmetric, and reads back as ``code * step + min``,
computed in float32 and rounded to the engine's dtype. A chunk is quantized once, by the worker
that stores it, and never again: every tier keeps the int8 bytes as they are.

An int8 chunk is ``[parameters | codes]``: the float32 parameters first (per plane: the
minimums, then the steps, each layer-major), then one code an element in the raw chunk's own
element order. Its size (`chunk_nbytes`) depends only on the scope and the chunk's tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from dataplane.memory.copies import CopySplitter, Placement
from dataplane.wire.kinds import KVFormat

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what int8 quantizes
_LEVELS = 255.0

# (a plane's view of a chunk, the dims its parameters reduce over)
_Plane = tuple[torch.Tensor, tuple[int, ...]]


@dataclass(frozen=True)
class Int8Shape:
    """The shape of a scope's chunks, enough to quantize one of ``tokens`` tokens."""

    kv_format: KVFormat
    num_layers: int
    heads: int
    head_dim: int
    block_size: int

    def planes(self, chunk: torch.Tensor, tokens: int, layers: int) -> list[_Plane]:
        """Each plane of ``layers`` layers of a chunk (``chunk``: any dtype, the raw chunk's
        element order) as a view whose dims reduced over leave one parameter a channel (keys,
        latents) or a token (values)."""
        h, d, bs = self.heads, self.head_dim, self.block_size
        if self.kv_format is KVFormat.TOKEN_MAJOR:
            x = chunk.view(layers, 2, tokens, h * d)
            return [(x[:, 0], (1,)), (x[:, 1], (2,))]
        nb = tokens // bs
        if self.kv_format is KVFormat.LATENT:
            return [(chunk.view(layers, nb, bs, d), (1, 2))]
        x = chunk.view(layers, nb, h, 2, d * bs)
        if self.kv_format is KVFormat.VLLM_CPU_AMX:  # K [d / 2][bs][2], V [bs / 2][d][2]
            keys = x[:, :, :, 0].view(layers, nb, h, d // 2, bs, 2)
            values = x[:, :, :, 1].view(layers, nb, h, bs // 2, d, 2)
            return [(keys, (1, 4)), (values, (2, 4))]
        # vllm_cpu: per block and head, K as [head_dim][block_size], then V as [block_size][head_dim]
        keys = x[:, :, :, 0].view(layers, nb, h, d, bs)
        values = x[:, :, :, 1].view(layers, nb, h, bs, d)
        return [(keys, (1, 4)), (values, (2, 4))]

    def param_counts(self, tokens: int) -> list[int]:
        """The parameters (minimum, step pairs) a layer of each plane of a chunk of ``tokens``."""
        channels = self.heads * self.head_dim
        if self.kv_format is KVFormat.LATENT:
            return [channels]
        return [channels, tokens]

    def elements(self, tokens: int) -> int:
        return self.num_layers * self.layer_elements(tokens)

    def layer_elements(self, tokens: int) -> int:
        return self.kv_format.planes * tokens * self.heads * self.head_dim

    def chunk_nbytes(self, tokens: int) -> int:
        """Bytes of an int8 chunk of ``tokens`` tokens."""
        return 2 * 4 * self.num_layers * sum(self.param_counts(tokens)) + self.elements(tokens)


class Int8Codec:
    """Quantizes raw chunks into int8 ones and back, for one scope's shape. Its float32 scratch
    is reused (a fresh one faults its pages in on every chunk): one chunk at a time."""

    def __init__(self, shape: Int8Shape) -> None:
        self.shape = shape
        self._f32 = torch.empty(0, dtype=torch.float32)

    def _scratch(self, tokens: int) -> torch.Tensor:
        n = self.shape.elements(tokens)
        if self._f32.numel() < n:
            self._f32 = torch.empty(n, dtype=torch.float32)
        return self._f32[:n]

    def _params(
        self, packed: torch.Tensor, tokens: int
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """(each plane's (minimums, steps), float32 [layers, count], the codes) of ``packed``."""
        s = self.shape
        if packed.numel() != s.chunk_nbytes(tokens):
            raise ValueError(
                f"an int8 chunk of {tokens} tokens is {s.chunk_nbytes(tokens)} bytes, got {packed.numel()}"
            )
        counts = s.param_counts(tokens)
        n_params = 2 * s.num_layers * sum(counts)
        params = packed[: 4 * n_params].view(torch.float32)
        out, at = [], 0
        for n in counts:
            size = s.num_layers * n
            pair = params[at : at + 2 * size]
            out.append((pair[:size].view(s.num_layers, n), pair[size:].view(s.num_layers, n)))
            at += 2 * size
        return out, packed[4 * n_params :]

    def _layers(
        self,
        f32: torch.Tensor,
        params: list[tuple[torch.Tensor, torch.Tensor]],
        tokens: int,
        lo: int,
        hi: int,
    ) -> Iterator[tuple[torch.Tensor, tuple[int, ...], torch.Tensor, torch.Tensor]]:
        """Per plane of layers [lo, hi) of the float32 chunk ``f32``: (its view, the dims its
        parameters reduce, the minimums and steps of those layers shaped to broadcast)."""
        per = self.shape.layer_elements(tokens)
        planes = self.shape.planes(f32[lo * per : hi * per], tokens, hi - lo)
        for (view, dims), (mins, steps) in zip(planes, params, strict=True):
            pshape = [1 if i in dims else n for i, n in enumerate(view.shape)]
            yield view, dims, mins[lo:hi].view(pshape), steps[lo:hi].view(pshape)

    def encode(
        self, raw: torch.Tensor, packed: torch.Tensor, tokens: int, splitter: CopySplitter | None = None
    ) -> None:
        """Quantize the raw chunk ``raw`` (the engine's dtype, flat) into ``packed`` (uint8,
        `Int8Shape.chunk_nbytes` bytes)."""
        params, codes = self._params(packed, tokens)
        f32, per = self._scratch(tokens), self.shape.layer_elements(tokens)

        def layers(lo: int, hi: int) -> None:
            f = f32[lo * per : hi * per]
            f.copy_(raw[lo * per : hi * per])
            for view, dims, mins, steps in self._layers(f32, params, tokens, lo, hi):
                low, high = _extremes(view, dims)
                step = (high - low) / _LEVELS
                step = torch.where(step > 0, step, torch.ones_like(step))  # a constant channel
                mins.copy_(low)
                steps.copy_(step)
                inv = 1.0 / step
                # x -> floor((x - min) / step + 1/2): the nearest code (the cast truncates)
                view.mul_(inv).add_(0.5 - low * inv)
            codes[lo * per : hi * per].copy_(f.clamp_(0, _LEVELS))

        _split(layers, self.shape.num_layers, splitter)

    def decode(
        self, packed: torch.Tensor, raw: torch.Tensor, tokens: int, splitter: CopySplitter | None = None
    ) -> None:
        """The int8 chunk ``packed`` back into ``raw`` (the engine's dtype, flat)."""
        params, codes = self._params(packed, tokens)
        f32, per = self._scratch(tokens), self.shape.layer_elements(tokens)

        def layers(lo: int, hi: int) -> None:
            f = f32[lo * per : hi * per]
            f.copy_(codes[lo * per : hi * per])
            for view, _, mins, steps in self._layers(f32, params, tokens, lo, hi):
                view.mul_(steps).add_(mins)
            raw[lo * per : hi * per].copy_(f)

        _split(layers, self.shape.num_layers, splitter)


def _extremes(f: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(minimum, maximum) of ``f`` over ``dims``, kept as dims of 1: the innermost dim first,
    a contiguous pass that shrinks what the strided ones read (``aminmax`` is slower here than
    the two)."""
    order = sorted(dims, reverse=True)
    lo, hi = f.amin(order[0], keepdim=True), f.amax(order[0], keepdim=True)
    for d in order[1:]:
        lo, hi = lo.amin(d, keepdim=True), hi.amax(d, keepdim=True)
    return lo, hi


def _split(fn: Callable[[int, int], None], n: int, splitter: CopySplitter | None) -> None:
    if splitter is None:
        fn(0, n)
    else:
        splitter.run(fn, n)


class _Memory(Protocol):
    block_size: int
    num_blocks: int

    def gather(self, where: Placement, buf: torch.Tensor, splitter: CopySplitter | None = None) -> None: ...

    def scatter(self, where: Placement, buf: torch.Tensor, splitter: CopySplitter | None = None) -> None: ...


class Int8KV:
    """A worker's KV memory (``local``, on the CPU) as int8 chunks: the worker-side copies
    (``gather``, ``scatter``) move a chunk through a raw scratch chunk, quantizing on the way
    out and dequantizing on the way in. Used by one transfer at a time (its caller's lock)."""

    def __init__(self, local: _Memory, shape: Int8Shape, dtype: torch.dtype) -> None:
        if dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"kv_compression int8 quantizes float KV (bfloat16, float16, float32), not {dtype}"
            )
        self.local = local
        self.codec = Int8Codec(shape)
        self.dtype = dtype
        self._item = torch.empty((), dtype=dtype).element_size()
        self._scratch = torch.empty(0, dtype=torch.uint8)

    @property
    def block_size(self) -> int:
        return self.local.block_size

    @property
    def num_blocks(self) -> int:
        return self.local.num_blocks

    def chunk_nbytes(self, n_tokens: int) -> int:
        return self.codec.shape.chunk_nbytes(n_tokens)

    def tokens_of(self, nbytes: int) -> int:
        """The tokens of an int8 chunk of ``nbytes`` bytes (ValueError when no chunk is)."""
        s = self.codec.shape
        base, per = s.chunk_nbytes(0), s.chunk_nbytes(1) - s.chunk_nbytes(0)
        tokens, rest = divmod(nbytes - base, per)
        if rest or tokens < 0:
            raise ValueError(f"{nbytes} bytes is not the size of an int8 chunk of this scope")
        return tokens

    def _raw(self, tokens: int) -> torch.Tensor:
        n = self.codec.shape.elements(tokens) * self._item
        if self._scratch.numel() < n:
            self._scratch = torch.empty(n, dtype=torch.uint8)
        return self._scratch[:n]

    def gather(self, where: Placement, buf: torch.Tensor, splitter: CopySplitter | None = None) -> None:
        """The chunk at ``where``, quantized into ``buf`` (uint8)."""
        packed = buf.view(torch.uint8)
        tokens = self.tokens_of(packed.numel())
        raw = self._raw(tokens)
        self.local.gather(where, raw, splitter)
        self.codec.encode(raw.view(self.dtype), packed, tokens, splitter)

    def scatter(self, where: Placement, buf: torch.Tensor, splitter: CopySplitter | None = None) -> None:
        """The int8 chunk ``buf``, dequantized into the blocks at ``where``."""
        packed = buf.view(torch.uint8)
        tokens = self.tokens_of(packed.numel())
        raw = self._raw(tokens)
        self.codec.decode(packed, raw.view(self.dtype), tokens, splitter)
        self.local.scatter(where, raw, splitter)
