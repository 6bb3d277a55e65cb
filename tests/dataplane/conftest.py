"""Fixtures shared by the data-plane unit tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from dataplane.client import allocate_kv_caches, free_kv_caches
from tests.helpers import FakeClock

Caches = list[torch.Tensor]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_caches() -> Iterator[Callable[[], Caches]]:
    """Tiny real shared-memory KV caches, freed after the test."""
    made: list[Caches] = []

    def make() -> Caches:
        c = allocate_kv_caches(2, 16, 16, 2, 8, torch.bfloat16)
        made.append(c)
        return c

    yield make
    for c in made:
        free_kv_caches(c)
