"""Fixtures of the L1 arena's tests (test_arena.py): a private segment directory, and arenas
closed at teardown."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dataplane.storage.l1.arena import Arena
from tests.dataplane.storage.l1.arena_helpers import use_dir


@pytest.fixture
def shm_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private directory on the shm tmpfs, the segment directory of this test."""
    d = Path(tempfile.mkdtemp(prefix="kvw-arena-", dir="/dev/shm"))
    use_dir(monkeypatch, d)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def arenas() -> Iterator[list[Arena]]:
    """Arenas a test made: every one closed at teardown, whatever happened."""
    made: list[Arena] = []
    yield made
    for a in made:
        a.close()
