"""A worker's paged KV memory laid out block-major, moved in whole blocks.

vLLM's CPU backend keeps each layer as ``[num_blocks, kv_heads, block_size, 2 * head_dim]``: per
block and head, K transposed (``[head_dim][block_size]``) then V (``[block_size][head_dim]``). A
token's K is strided across the block, so such memory moves only in whole blocks, as bytes: a
chunk is ``[layers, blocks, block_bytes]``, each block exactly as the engine keeps it (format
``vllm_cpu``, `dataplane.wire.messages.KVFormat`). Multi-head latent attention keeps one
latent vector a token, ``[num_blocks, 1, block_size, latent_dim]``, moved the same way (format
``latent``). The same interface as
`dataplane.memory.kvmemory.MappedKV` for the worker-side copies (``gather``, ``scatter``,
``block_size``, ``num_blocks``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dataplane.memory.copies import Blocks, CopySplitter, Placement, whole_blocks
from dataplane.memory.int8 import Int8KV
from dataplane.memory.kvmemory import MappedKV
from dataplane.wire.kinds import KVFormat


@dataclass
class BlockKV:
    num_layers: int
    num_blocks: int
    block_size: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    block_bytes: int
    layers: list[torch.Tensor]  # per layer: uint8 [num_blocks, block_bytes] (block stride as given)

    @classmethod
    def of_vllm_cpu(cls, caches: Sequence[torch.Tensor]) -> BlockKV:
        """Per layer ``[num_blocks, heads, block_size, 2 * head_dim]``, each block contiguous
        (ValueError naming what is not)."""
        return cls.of_engine(caches, KVFormat.VLLM_CPU)

    @classmethod
    def of_engine(cls, caches: Sequence[torch.Tensor], kv_format: KVFormat) -> BlockKV:
        """Per layer ``[num_blocks, heads, block_size, planes * head_dim]`` (``vllm_cpu``: K and
        V, 2 planes; ``latent``: one latent a token, 1 plane and 1 head), each block contiguous
        (ValueError naming what is not)."""
        first, planes = caches[0], kv_format.planes
        shape = "[num_blocks, 1, block_size, latent_dim]"
        if planes == 2:
            shape = "[num_blocks, heads, block_size, 2 * head_dim]"
        if first.dim() != 4 or first.shape[3] % planes or (planes == 1 and first.shape[1] != 1):
            raise ValueError(f"{kv_format.value} KV tensors must be {shape}, got {list(first.shape)}")
        nb, heads, bs, row = (int(x) for x in first.shape)
        layers = []
        for i, t in enumerate(caches):
            if t.shape != first.shape or t.dtype != first.dtype or t.device.type != "cpu":
                raise ValueError(f"layer {i}: shape/dtype/device differ from layer 0 (or not on the CPU)")
            if not t[0].is_contiguous():
                raise ValueError(f"layer {i}: a block is not contiguous (strides {list(t.stride())})")
            layers.append(t.flatten(1).view(torch.uint8))
        block_bytes = heads * bs * row * first.element_size()
        return cls(len(caches), nb, bs, heads, row // planes, first.dtype, block_bytes, layers)

    def chunk_nbytes(self, n_tokens: int) -> int:
        return self.num_layers * (n_tokens // self.block_size) * self.block_bytes

    def _blocks(self, where: Placement) -> np.ndarray:
        if isinstance(where, Blocks):
            return where.ids
        blocks = whole_blocks(where, self.block_size)
        if blocks is None:
            raise ValueError(f"block-major memory moves whole blocks of {self.block_size} tokens only")
        return blocks

    def gather(self, where: Placement, buf: torch.Tensor, splitter: CopySplitter | None = None) -> None:
        """The whole blocks ``where`` covers, into the chunk ``buf`` (uint8)."""
        blocks = self._blocks(where)
        if len(blocks) and blocks.min() < 0:
            raise ValueError("a chunk with blocks not written (-1) cannot be stored")
        out = buf.view(torch.uint8).view(self.num_layers, len(blocks), self.block_bytes)
        idx = torch.from_numpy(blocks)

        def layers(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                torch.index_select(self.layers[i], 0, idx, out=out[i])

        self._run(layers, splitter)

    def scatter(self, where: Placement, buf: torch.Tensor, splitter: CopySplitter | None = None) -> None:
        """The chunk ``buf`` into the blocks ``where`` covers; a block id of -1 is left alone
        (`dataplane.memory.copies.ChunkMap`)."""
        blocks = self._blocks(where)
        src = buf.view(torch.uint8).view(self.num_layers, len(blocks), self.block_bytes)
        keep = blocks >= 0
        whole = bool(keep.all())

        def layers(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                if whole:
                    self.layers[i].numpy()[blocks] = src[i].numpy()
                else:
                    self.layers[i].numpy()[blocks[keep]] = src[i].numpy()[keep]

        self._run(layers, splitter)

    def _run(self, layers: Callable[[int, int], None], splitter: CopySplitter | None) -> None:
        if splitter is None:
            layers(0, self.num_layers)
        else:
            splitter.run(layers, self.num_layers)


# a worker's own KV memory, as the worker-side copies see it
LocalKV = MappedKV | BlockKV | Int8KV
