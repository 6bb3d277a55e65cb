"""`BlockCopier`: a prefix this engine is still saving, copied block to block within the worker's
own KV caches (vLLM's CPU layout and the token-major one), every other block left as it was."""

from __future__ import annotations

import pytest
import torch

from dataplane.client.vllm.worker import BlockCopier


def _caches(shape: tuple[int, ...], layers: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(layers)]


@pytest.mark.parametrize(
    ("shape", "dim"),
    [((12, 2, 4, 8), 0), ((2, 12, 4, 2, 4), 1)],  # vllm_cpu [blocks, ...]; token-major [2, blocks, ...]
)
@pytest.mark.parametrize("max_runs", [64, 0])  # slices of runs; one indexed copy per layer
def test_each_destination_block_gets_its_source_block_and_nothing_else_changes(
    shape: tuple[int, ...], dim: int, max_runs: int
) -> None:
    caches = _caches(shape)
    before = [t.clone() for t in caches]
    src, dst = [1, 2, 3, 7, 8], [5, 6, 9, 10, 11]  # two runs in both
    copier = BlockCopier(caches, dim)
    copier.MAX_RUNS = max_runs
    copier(src, dst)
    for t, old in zip(caches, before, strict=True):
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(t.select(dim, d), old.select(dim, s))
        for b in set(range(12)) - set(dst):
            assert torch.equal(t.select(dim, b), old.select(dim, b))


def test_source_and_destination_counts_must_agree() -> None:
    with pytest.raises(ValueError, match="2 source blocks for 1 blocks"):
        BlockCopier(_caches((4, 1, 2, 2)), 0)([0, 1], [2])
