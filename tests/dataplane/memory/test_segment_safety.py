"""What a REGISTER may make the server map, space reserved at create, and the sweep of a dead
creator's temporary file.

Every case runs in a private directory on the shm tmpfs (as tests/dataplane/memory/test_shm.py does);
the no-room case mounts a small tmpfs of its own (root only). One case goes end to end through a
real `kvwarden serve`: every unsafe segment gets INVALID_LAYOUT naming the layer and the reason,
the victim a symbolic link points at keeps its bytes, and the server goes on serving.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from dataplane.client import WorkerAdapter, allocate_kv_caches, free_kv_caches
from dataplane.memory import shm
from dataplane.memory.kvmemory import map_registration
from dataplane.memory.shm import Segment, sweep_orphans
from dataplane.wire.errors import InvalidLayout
from dataplane.wire.messages import Register, ShmLayer
from dataplane.wire.protocol import encode_message
from tests.conftest import DealerFactory, ServerFactory
from tests.dataplane.registration import register_message, segment_of
from tests.helpers import (
    ROOT,
    LineReader,
    call,
    error_of,
    mounted_tmpfs,
    new_name,
    next_rid,
    ping,
    subprocess_env,
)

Caches = list[torch.Tensor]
LAYER_BYTES = 2 * 16 * 16 * 2 * 8 * 2  # one layer of the `make_caches` layout (bfloat16)
VICTIM = bytes(range(256)) * (2 * LAYER_BYTES // 256)  # big enough to hold both layers
CREATING_PREFIX = ".kvwarden-creating-"  # Segment.create's temporary name, before its rename
KINDS = ["symlink", "directory", "fifo", "foreign_owner", "sparse"]

# Emulates Segment.create killed between its O_CREAT and its rename: the temporary file, locked.
CREATOR = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
fcntl.flock(fd, fcntl.LOCK_SH)
os.ftruncate(fd, 4096)
print("locked", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def shm_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private directory on the shm tmpfs, for this process and every server it starts."""
    d = Path(tempfile.mkdtemp(prefix="kvw-safety-", dir="/dev/shm"))
    monkeypatch.setattr(shm, "SHM_DIR", d)
    monkeypatch.setenv("KVWARDEN_SHM_DIR", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def make_victim(directory: Path) -> Path:
    victim = directory / "victim"
    victim.write_bytes(VICTIM)
    return victim


def make_unsafe(kind: str, path: Path, victim: Path) -> str:
    """Put an unsafe entry of ``kind`` at ``path``; the reason attach gives (a regex)."""
    size = len(VICTIM)
    if kind == "symlink":
        path.symlink_to(victim)
        return "is a symbolic link"
    if kind == "directory":
        path.mkdir()
        return r"is not a regular file \(it is a directory\)"
    if kind == "fifo":
        os.mkfifo(path)
        return r"is not a regular file \(it is a FIFO\)"
    if kind == "foreign_owner":
        if os.geteuid() != 0:
            pytest.skip("giving a file to another uid needs root")
        path.write_bytes(VICTIM)
        os.chown(path, 65534, 65534)
        return f"is owned by uid 65534, not uid {os.geteuid()}"
    assert kind == "sparse"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)  # a size, and no page behind it
    finally:
        os.close(fd)
    return f"is sparse: 0 of {size} bytes allocated; create it with posix_fallocate"


def naming(name: str, caches: Caches, instance_id: int = 1) -> Register:
    """A valid REGISTER of ``caches`` whose layers all name segment ``name`` instead."""
    reg = register_message(instance_id, caches)
    layers = [lay for lay in reg.layers if isinstance(lay, ShmLayer)]
    assert len(layers) == len(reg.layers)
    return dataclasses.replace(reg, layers=tuple(dataclasses.replace(lay, segment=name) for lay in layers))


@pytest.mark.parametrize("kind", KINDS)
def test_attach_refuses_an_unsafe_segment(
    kind: str, shm_dir: Path, tmp_path: Path, make_caches: Callable[[], Caches]
) -> None:
    victim = make_victim(tmp_path)
    name = new_name()
    reason = make_unsafe(kind, shm_dir / name, victim)
    with pytest.raises(ValueError, match=f"^segment {name} {reason}"):
        Segment.attach(name, len(VICTIM))
    with pytest.raises(InvalidLayout, match=f"^layer 0: segment {name} {reason}"):
        map_registration(naming(name, make_caches()))
    assert victim.read_bytes() == VICTIM


def test_a_segment_that_cannot_be_opened_is_an_invalid_layout(
    shm_dir: Path, make_caches: Callable[[], Caches]
) -> None:
    """An OSError of attach (here EPERM: an immutable file cannot be opened for writing, even
    by root) is an InvalidLayout naming the layer and the reason, not an internal error."""
    if os.geteuid() != 0 or shutil.which("chattr") is None:
        pytest.skip("making a file immutable needs root and chattr(1)")
    name = new_name()
    path = shm_dir / name
    path.write_bytes(VICTIM)
    r = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True, timeout=30)
    if r.returncode:
        pytest.skip(f"this filesystem keeps no immutable flag: {r.stderr.strip()}")
    try:
        with pytest.raises(PermissionError):
            Segment.attach(name, len(VICTIM))
        with pytest.raises(
            InvalidLayout, match=f"^layer 0: cannot map segment {name}: Operation not permitted$"
        ):
            map_registration(naming(name, make_caches()))
    finally:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True, timeout=30, check=True)


def test_attach_maps_a_real_segment(shm_dir: Path, make_caches: Callable[[], Caches]) -> None:
    caches = make_caches()
    name = segment_of(caches)
    st = (shm_dir / name).stat()
    assert st.st_blocks * 512 >= st.st_size == 2 * LAYER_BYTES  # reserved at create, not sparse
    assert not [p for p in shm_dir.iterdir() if p.name.startswith(CREATING_PREFIX)]
    caches[1].fill_(1.5)
    kv = map_registration(register_message(1, caches))
    try:
        assert kv.num_layers == 2 and kv.stacked is not None
        assert torch.equal(kv.stacked[1].reshape(-1), caches[1].reshape(-1))
        kv.stacked[0].fill_(-2.0)  # the server's writes are the worker's bytes
        assert float(caches[0].float().mean()) == -2.0
    finally:
        assert kv.release()


def test_allocate_kv_caches_without_room_fails_at_create(monkeypatch: pytest.MonkeyPatch) -> None:
    """The segment's space is reserved at create: no room is a clear ENOSPC there, not a SIGBUS
    at the first write of a page the tmpfs cannot back."""
    with mounted_tmpfs("1m") as d:
        monkeypatch.setattr(shm, "SHM_DIR", d)
        first = allocate_kv_caches(1, 64, 16, 8, 16, torch.bfloat16)  # 512 KiB of the 1 MiB
        try:
            free = os.statvfs(d).f_bavail * os.statvfs(d).f_frsize
            want = 2 * 96 * 16 * 8 * 16 * 2  # 768 KiB: below the tmpfs's size, above its room
            assert free < want
            with pytest.raises(OSError) as info:
                allocate_kv_caches(1, 96, 16, 8, 16, torch.bfloat16)
            assert info.value.errno == errno.ENOSPC
            assert str(d) in str(info.value) and f"{want} bytes" in str(info.value), str(info.value)
            assert [p.name for p in d.iterdir()] == [segment_of(first)]  # no temporary left
            assert os.statvfs(d).f_bavail * os.statvfs(d).f_frsize == free  # its room given back
        finally:
            free_kv_caches(first)
            del first


def test_server_refuses_every_unsafe_segment_end_to_end(
    shm_dir: Path,
    tmp_path: Path,
    make_server: ServerFactory,
    make_dealer: DealerFactory,
    make_caches: Callable[[], Caches],
) -> None:
    victim = make_victim(tmp_path)
    srv = make_server("--chunk-size", "16")  # after shm_dir: its start-up sweep sees nothing
    sock = make_dealer(srv.endpoint)
    caches = make_caches()
    kinds = KINDS if os.geteuid() == 0 else [k for k in KINDS if k != "foreign_owner"]
    for k, kind in enumerate(kinds):
        name = new_name()
        reason = make_unsafe(kind, shm_dir / name, victim)
        code, message = error_of(call(sock, encode_message(next_rid(), naming(name, caches, 100 + k))))
        assert code == "INVALID_LAYOUT", (kind, code, message)
        assert re.match(f"layer 0: segment {name} {reason}", message), (kind, message)
        ping(sock)  # answered: the refusal cost the server nothing
    assert victim.read_bytes() == VICTIM
    adapter = WorkerAdapter(srv.endpoint, "m", heartbeat_interval=5.0)
    try:
        adapter.register_kv_caches(caches)  # the good case still works
        for c in caches:
            c.copy_(torch.randn(c.shape).to(c.dtype))
        want = [c.clone() for c in caches]
        tokens, blocks = np.arange(256), np.arange(16)
        assert adapter.store(tokens, blocks)
        for c in caches:
            c.zero_()
        assert adapter.retrieve(tokens, blocks) == 256
        assert all(torch.equal(a, b) for a, b in zip(caches, want, strict=True))
    finally:
        adapter.close()
    assert victim.read_bytes() == VICTIM
    assert srv.proc.poll() is None
    assert srv.stop() == 0, srv.output()
    assert "Traceback" not in srv.output(), srv.output()


def spawn_creator(path: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CREATOR, str(path)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=subprocess_env(),
    )
    assert LineReader(proc).readline(60) == "locked"
    return proc


def age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_sweep_unlinks_a_dead_creators_temporary_file(
    shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tmp = shm_dir / f"{CREATING_PREFIX}{secrets.token_hex(8)}"
    creator = spawn_creator(tmp)
    try:
        age(tmp, 3600)
        assert sweep_orphans() == []  # old, but locked: its creator lives
        assert tmp.exists()
        creator.kill()
        creator.wait(30)
        age(tmp, 0)
        assert sweep_orphans() == []  # unlocked, but young: a creator may be between O_CREAT and flock
        assert tmp.exists()
        age(tmp, 3600)
        with caplog.at_level(logging.INFO, logger="dataplane.memory.shm"):
            assert sweep_orphans() == [tmp.name]
        assert not tmp.exists()
        assert f"unlinked {tmp.name}" in caplog.text and "creator died" in caplog.text, caplog.text
        assert "swept 1 abandoned temporary file(s)" in caplog.text, caplog.text
    finally:
        if creator.poll() is None:
            creator.kill()
        creator.wait(30)
        for f in (creator.stdin, creator.stdout):
            if f is not None:
                f.close()


@pytest.mark.parametrize("kind", ["symlink", "directory", "fifo", "bad_name"])
def test_sweep_keeps_odd_entries_named_like_temporary_files(kind: str, shm_dir: Path, tmp_path: Path) -> None:
    victim = make_victim(tmp_path)
    path = shm_dir / f"{CREATING_PREFIX}{secrets.token_hex(8)}"
    if kind == "bad_name":
        path = shm_dir / f"{CREATING_PREFIX}not-hex"
        path.write_bytes(b"x")
    else:
        make_unsafe(kind, path, victim)
    os.utime(path, (time.time() - 3600,) * 2, follow_symlinks=False)
    assert sweep_orphans() == []
    assert os.path.lexists(path)
    assert victim.read_bytes() == VICTIM
