"""Shared-memory segments: create/attach, flock ownership, orphan unlinking with real processes."""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dataplane.client import allocate_kv_caches, free_kv_caches
from dataplane.memory import shm
from dataplane.memory.shm import (
    Segment,
    owner_alive,
    sweep_orphans,
    unlink_if_owner_gone,
    unlink_segment,
    valid_segment_name,
)
from tests.helpers import ROOT, LineReader, subprocess_env, wait_until

HOLD_SEGMENT = """
import sys
from dataplane.memory.shm import Segment
seg = Segment.create(int(sys.argv[1]))
seg.mm[:4] = b"live"
print(seg.name, flush=True)
sys.stdin.read()  # hold the segment (and its lock) until the test closes our stdin
"""

ALLOCATE_AND_EXIT = """
import torch
from dataplane.client import allocate_kv_caches
from dataplane.memory.shm import SHM_DIR
caches = allocate_kv_caches(2, 4, 16, 2, 8, dtype=torch.bfloat16)
print(sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith("kvwarden-"))[0], flush=True)
"""


@pytest.fixture
def shm_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private directory on the shm tmpfs, so sweeps here never touch anyone else's segments."""
    d = Path(tempfile.mkdtemp(prefix="kvw-test-", dir="/dev/shm"))
    monkeypatch.setattr(shm, "SHM_DIR", d)
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Holder:
    """A child process that owns one segment until told to exit, or killed."""

    def __init__(self, directory: Path, size: int = 4096) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLD_SEGMENT, str(size)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=subprocess_env(KVWARDEN_SHM_DIR=str(directory)),
        )
        self.name = LineReader(self.proc).readline(60)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


@pytest.fixture
def holder(shm_dir: Path) -> Iterator[Holder]:
    h = Holder(shm_dir)
    yield h
    h.close()


def test_segment_names() -> None:
    assert valid_segment_name("kvwarden-123-0123456789abcdef")
    for bad in (
        "kvwarden-123-0123456789abcde",
        "kvwarden-x-0123456789abcdef",
        "kvwarden-1-0123456789ABCDEF",
        "../kvwarden-1-0123456789abcdef",
        "kvwarden-1-0123456789abcdef/../x",
        "",
        "kvwarden-",
        "other-1-0123456789abcdef",
    ):
        assert not valid_segment_name(bad), bad


def test_create_and_attach_in_dev_shm() -> None:
    seg = Segment.create(8192)
    try:
        assert seg.owner and seg.size == 8192
        assert valid_segment_name(seg.name)
        assert seg.name.startswith(f"kvwarden-{os.getpid()}-")
        path = Path("/dev/shm") / seg.name
        assert path.stat().st_size == 8192
        assert oct(path.stat().st_mode & 0o777) == oct(0o600)
        seg.mm[:5] = b"hello"
        other = Segment.attach(seg.name, 8192)
        assert not other.owner and other.size == 8192
        assert other.mm[:5] == b"hello"
        other.mm[8000:8003] = b"abc"
        assert seg.mm[8000:8003] == b"abc"  # the same memory, not a copy
        assert other.close()
        with pytest.raises(ValueError, match="holds 8192 bytes, the layout needs 8193"):
            Segment.attach(seg.name, 8193)
        assert not any(
            p.name.startswith(".kvwarden-creating-") and str(os.getpid()) in p.name
            for p in Path("/dev/shm").iterdir()
        )
    finally:
        assert seg.close()
        seg.unlink()
    assert not (Path("/dev/shm") / seg.name).exists()
    assert unlink_segment(seg.name) is False


def test_attach_refuses_foreign_names_and_missing_segments(shm_dir: Path) -> None:
    (shm_dir / "victim").write_bytes(b"x" * 100)
    for name in ("../" + shm_dir.name + "/victim", "victim", "kvwarden-1-zz", "/etc/passwd"):
        with pytest.raises(ValueError, match="is not a kvwarden segment"):
            Segment.attach(name, 1)
    with pytest.raises(FileNotFoundError):
        Segment.attach("kvwarden-1-0123456789abcdef", 1)


def test_close_with_a_live_memoryview(shm_dir: Path) -> None:
    seg = Segment.create(4096)
    view = memoryview(seg.mm)
    assert seg.close() is False  # still exported: nothing was unmapped
    view[0] = 7
    assert seg.mm[0] == 7
    view.release()
    assert seg.close() is True
    seg.unlink()


def test_close_with_a_live_tensor_view(shm_dir: Path) -> None:
    """A tensor viewing the segment the way the server maps it keeps the mapping alive."""
    seg = Segment.create(4096)
    view = seg.as_tensor()  # as kvmemory._map_shm builds its views
    closed = seg.close()
    if closed:
        # the memory under ``view`` is gone: touching it now would crash this process
        del view
        raise AssertionError("Segment.close() unmapped memory that a live tensor still views")
    view[0] = 7
    del view
    assert seg.close() is True
    seg.unlink()


def test_owner_alive_follows_the_lock_in_process(shm_dir: Path) -> None:
    seg = Segment.create(4096)
    assert owner_alive(seg.name) is True
    assert unlink_if_owner_gone(seg.name) is False
    assert sweep_orphans() == []
    assert (shm_dir / seg.name).exists()
    assert seg.close()  # closing drops the owner's lock: the segment is now an orphan
    assert owner_alive(seg.name) is False
    assert unlink_if_owner_gone(seg.name) is True
    assert not (shm_dir / seg.name).exists()
    assert owner_alive(seg.name) is False  # missing counts as gone


def test_owner_alive_while_child_lives_and_not_after_sigkill(holder: Holder, shm_dir: Path) -> None:
    name = holder.name
    assert name.startswith(f"kvwarden-{holder.proc.pid}-")
    attached = Segment.attach(name, 4096)
    assert attached.mm[:4] == b"live"
    assert owner_alive(name) is True
    assert unlink_if_owner_gone(name) is False
    assert (shm_dir / name).exists()
    # attaching (and probing) never takes ownership
    assert owner_alive(name) is True
    holder.kill()
    assert owner_alive(name) is False
    assert attached.mm[:4] == b"live"  # our mapping outlives the owner
    assert unlink_if_owner_gone(name) is True
    assert not (shm_dir / name).exists()
    assert attached.close()


def test_sweep_removes_only_dead_owners_segments(shm_dir: Path) -> None:
    dead, live = Holder(shm_dir), Holder(shm_dir)
    try:
        mine = Segment.create(4096)
        (shm_dir / "kvwarden-notes").write_text("not a segment")
        (shm_dir / "unrelated").write_text("x")
        assert sweep_orphans() == []
        dead.kill()
        assert sweep_orphans() == [dead.name]
        remaining = sorted(p.name for p in shm_dir.iterdir())
        assert remaining == sorted([live.name, mine.name, "kvwarden-notes", "unrelated"])
        assert sweep_orphans() == []
        live.kill()
        assert sweep_orphans() == [live.name]
        assert mine.close()
        assert sweep_orphans() == [mine.name]
        assert sorted(p.name for p in shm_dir.iterdir()) == ["kvwarden-notes", "unrelated"]
    finally:
        dead.close()
        live.close()


def test_child_that_exits_normally_leaves_an_orphan_until_swept(holder: Holder, shm_dir: Path) -> None:
    assert holder.proc.stdin is not None
    holder.proc.stdin.close()  # the child returns from read() and exits without unlinking
    assert holder.proc.wait(30) == 0
    assert (shm_dir / holder.name).exists()
    assert owner_alive(holder.name) is False
    assert sweep_orphans() == [holder.name]


def test_allocated_caches_are_unlinked_at_normal_exit(shm_dir: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", ALLOCATE_AND_EXIT],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        env=subprocess_env(KVWARDEN_SHM_DIR=str(shm_dir)),
    )
    try:
        name = LineReader(proc).readline(60)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        assert proc.stdout is not None
        proc.stdout.close()
    assert valid_segment_name(name)
    wait_until(lambda: not (shm_dir / name).exists(), 5, what="atexit unlink")


def test_allocate_and_free_kv_caches(shm_dir: Path) -> None:
    caches = allocate_kv_caches(
        num_layers=3, num_blocks=8, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.float16
    )
    assert len(caches) == 3
    assert all(c.shape == (2, 8, 16, 2, 8) and c.dtype == torch.float16 for c in caches)
    assert all(c.is_contiguous() for c in caches)
    assert all(not c.any() for c in caches)  # zero-filled
    names = [p.name for p in shm_dir.iterdir()]
    assert len(names) == 1 and valid_segment_name(names[0])  # all layers in one segment
    assert (shm_dir / names[0]).stat().st_size == 3 * 2 * 8 * 16 * 2 * 8 * 2
    caches[2].fill_(1.5)
    peer = Segment.attach(names[0], 1)
    last = torch.frombuffer(peer.mm, dtype=torch.float16)[-1].item()
    assert last == 1.5  # the server-visible bytes are the tensors' bytes
    del last
    free_kv_caches(caches)
    assert not (shm_dir / names[0]).exists()
    caches[0].fill_(2.0)  # the mapping stays valid after the unlink
    assert float(caches[0].sum()) == 2.0 * caches[0].numel()
    assert peer.close()


def test_freeing_caches_lets_go_of_the_owner_lock(shm_dir: Path) -> None:
    """Allocating and freeing caches again and again holds no file descriptor per round."""

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    free_kv_caches(allocate_kv_caches(1, 2, 16, 1, 8, torch.float16))  # first-use imports settle
    gc.collect()
    before = open_fds()
    for _ in range(5):
        caches = allocate_kv_caches(1, 2, 16, 1, 8, torch.float16)
        assert open_fds() > before  # the owner's lock (and the mapping) while it is in use
        free_kv_caches(caches)
        del caches
        gc.collect()  # the tensors were the mapping's last users
        assert open_fds() == before
    assert list(shm_dir.iterdir()) == []


@pytest.mark.parametrize("bad", [{"num_layers": 0}, {"num_blocks": -1}, {"head_dim": 0}])
def test_allocate_rejects_bad_shapes(bad: dict[str, int]) -> None:
    args = {"num_layers": 1, "num_blocks": 1, "block_size": 1, "num_kv_heads": 1, "head_dim": 1}
    args.update(bad)
    with pytest.raises(ValueError, match=f"{next(iter(bad))} must be > 0"):
        allocate_kv_caches(**args)


def test_allocate_rejects_unsupported_dtype() -> None:
    with pytest.raises(ValueError, match="not supported"):
        allocate_kv_caches(1, 1, 1, 1, 1, dtype=torch.float64)


SWEEP = """
import gc
import json
from dataplane.memory.shm import sweep_orphans
print(json.dumps(sweep_orphans()), flush=True)
"""


def run_sweep(directory: Path) -> list[str]:
    """``sweep_orphans()`` in a fresh process, bounded in time."""
    try:
        r = subprocess.run(
            [sys.executable, "-c", SWEEP],
            cwd=ROOT,
            env=subprocess_env(KVWARDEN_SHM_DIR=str(directory)),
            capture_output=True,
            text=True,
            timeout=10,
        )
    except subprocess.TimeoutExpired:
        raise AssertionError("sweep_orphans() hung") from None
    assert r.returncode == 0, r.stderr.strip().splitlines()[-1:]
    swept: list[str] = json.loads(r.stdout)
    return swept


@pytest.mark.parametrize("odd", ["directory", "fifo"])
def test_sweep_survives_odd_entries_named_like_segments(shm_dir: Path, odd: str) -> None:
    """An entry that is not a segment file must neither crash nor hang the start-up sweep."""
    strange = shm_dir / "kvwarden-1-0123456789abcdef"
    if odd == "directory":
        strange.mkdir()
    else:
        os.mkfifo(strange)
    orphan = Segment.create(4096)
    assert orphan.close()  # its owner's lock is gone: a genuine orphan
    assert run_sweep(shm_dir) == [orphan.name]
    assert not (shm_dir / orphan.name).exists()
