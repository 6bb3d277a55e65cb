"""The worker maps the server's arena ahead of its copies (`ArenaToucher`): only what the server
has reserved (reading a hole of the segment would allocate it), up to a lookahead past the
highest offset handed out, and it stops and joins while waiting for more."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dataplane.client import one_copy
from dataplane.client.one_copy import ArenaToucher
from dataplane.memory import shm
from dataplane.memory.shm import Segment
from tests.helpers import wait_until

MiB = 1 << 20


@pytest.fixture
def shm_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvw-touch-", dir="/dev/shm"))
    monkeypatch.setattr(shm, "SHM_DIR", d)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def mapped_rss(name: str) -> int:
    """Bytes of this process's mappings of segment ``name`` that are mapped (smaps Rss)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's first line
            inside = line.rstrip().endswith(name)
        elif inside and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


def allocated(seg: Segment) -> int:
    return os.fstat(seg.lock_fd).st_blocks * 512


def test_maps_what_is_reserved_and_nothing_past_it(shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(one_copy, "LOOKAHEAD", 16 * MiB)
    owner = Segment.create(64 * MiB, reserve=False)  # the server's arena: reserved as it grows
    worker: Segment | None = None
    t: ArenaToucher | None = None
    try:
        os.posix_fallocate(owner.lock_fd, 0, 8 * MiB)
        worker = Segment.attach(owner.name, 64 * MiB, allow_sparse=True)
        assert mapped_rss(owner.name) == 0
        t = ArenaToucher(worker.as_tensor(), usable=8 * MiB)
        t.start()
        wait_until(lambda: t is not None and t.mapped == 8 * MiB, 10.0, what="first 8 MiB mapped")
        assert mapped_rss(owner.name) >= 8 * MiB  # mapped into this process, not just reserved
        assert allocated(owner) == 8 * MiB  # a read past the reserve would have allocated

        # more reserved, offsets up to 20 MiB handed out: mapped up to 20 + 16 MiB of lookahead
        os.posix_fallocate(owner.lock_fd, 0, 48 * MiB)
        t.want(20 * MiB, 48 * MiB)
        wait_until(lambda: t is not None and t.mapped == 36 * MiB, 10.0, what="lookahead mapped")
        assert 36 * MiB <= mapped_rss(owner.name) < 48 * MiB
        # a lower offset or a smaller reserve never moves it back
        t.want(1 * MiB, 4 * MiB)
        assert t.mapped == 36 * MiB
        # past the end of the arena: clamped to it
        os.posix_fallocate(owner.lock_fd, 0, 64 * MiB)
        t.want(60 * MiB, 1 << 40)
        wait_until(lambda: t is not None and t.mapped == 64 * MiB, 10.0, what="whole arena mapped")
        assert allocated(owner) == 64 * MiB
    finally:
        if t is not None:
            t.stop()
            assert t.join(5.0), "the toucher did not stop while waiting"
        if worker is not None:
            worker.close()
        owner.unlink()
        owner.close()


def test_stops_while_idle_before_anything_is_reserved(shm_dir: Path) -> None:
    owner = Segment.create(4 * MiB, reserve=False)
    worker = Segment.attach(owner.name, 4 * MiB, allow_sparse=True)
    try:
        t = ArenaToucher(worker.as_tensor(), usable=0)
        t.start()
        t.stop()
        assert t.join(5.0)
        assert t.mapped == 0 and allocated(owner) == 0
    finally:
        worker.close()
        owner.unlink()
        owner.close()
