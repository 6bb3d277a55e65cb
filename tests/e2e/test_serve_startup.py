"""`kvwarden serve` start-up, end to end: the sweep of orphaned shared-memory segments, and the
staged start (PING answered before the data plane is built, other requests held until it is).

A real orphan (a segment whose creating process has exited: its flock is gone) and a live
segment (owned by this test process, flock held) wait in a private directory on the shm tmpfs
(``KVWARDEN_SHM_DIR``, as the shm tests use), so the server sweeps exactly what this test put
there and never anybody else's segments in /dev/shm. Then a real `kvwarden serve` starts: once
it answers, the orphan is gone, the live segment is kept, and its log says it swept 1 segment.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from dataplane.memory import shm
from dataplane.memory.shm import Segment, owner_alive
from dataplane.wire.messages import Lookup, Ping
from dataplane.wire.protocol import decode_reply, encode_message
from tests.conftest import ServerFactory
from tests.helpers import ROOT, ServerProcess, free_port, subprocess_env

CREATE_AND_EXIT = """
from dataplane.memory.shm import Segment
seg = Segment.create(4096)
seg.mm[:6] = b"orphan"
print(seg.name, flush=True)
# exits without close or unlink: the kernel drops the owner's flock, the file stays
"""


@pytest.fixture
def shm_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private directory on the shm tmpfs, for this process and (through the environment the
    servers inherit) every `kvwarden serve` it starts."""
    d = Path(tempfile.mkdtemp(prefix="kvw-startup-", dir="/dev/shm"))
    monkeypatch.setattr(shm, "SHM_DIR", d)
    monkeypatch.setenv("KVWARDEN_SHM_DIR", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def make_orphan(directory: Path) -> str:
    """A segment made by a child process that has exited; its name."""
    r = subprocess.run(
        [sys.executable, "-c", CREATE_AND_EXIT],
        cwd=ROOT,
        env=subprocess_env(KVWARDEN_SHM_DIR=str(directory)),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return r.stdout.strip()


def test_serve_sweeps_orphaned_segments_at_start_and_keeps_live_ones(
    shm_dir: Path, make_server: ServerFactory
) -> None:
    orphan = make_orphan(shm_dir)
    assert (shm_dir / orphan).is_file()
    assert not owner_alive(orphan)  # a real orphan: its owner has exited
    live = Segment.create(4096)
    try:
        assert owner_alive(live.name)
        srv = make_server()  # returns once the server answers HELLO
        try:
            assert not (shm_dir / orphan).exists(), "the orphan survived the start-up sweep"
            assert (shm_dir / live.name).is_file(), "a live owner's segment was swept"
            log = srv.output()
            assert "shm: swept 1 orphaned segment(s) at start" in log, log
            assert f"unlinked segment {orphan}" in log, log
            assert live.name not in log, log
        finally:
            rc = srv.stop()
        assert rc == 0, f"server exited {rc}:\n{srv.output()}"
        assert "Traceback" not in srv.output(), srv.output()
    finally:
        assert live.close()
        live.unlink()


def test_ping_is_answered_while_the_data_plane_is_built_and_held_requests_after(tmp_path: Path) -> None:
    """A worker's LOOKUP and PING queued before `kvwarden serve` starts: the PING is answered
    first (the server answers it before importing torch), with the boot token HELLO gives later;
    the LOOKUP, held meanwhile, is answered once the data plane is up, as it would have been
    (the instance is unknown: NOT_REGISTERED), not refused for arriving early."""
    port = free_port()
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RECONNECT_IVL, 2)  # ms: connected as soon as the server binds
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send(encode_message(1, Lookup(77, bytes(16), np.arange(8, dtype="<i4"))))
    sock.send(encode_message(2, Ping(77, bytes(16))))
    srv = ServerProcess(tmp_path, port=port)
    try:
        order = []
        for _ in range(2):
            assert sock.poll(60_000), "no reply:\n" + srv.output()
            r = decode_reply(sock.recv())
            order.append(r)
        ping, held = order
        assert ping.request_id == 2 and ping.ok and ping.body["tracked"] is False
        assert held.request_id == 1 and not held.ok and held.body["code"] == "NOT_REGISTERED"
        info = srv.wait_ready()
        assert info["boot_token"] == ping.body["boot_token"]
    finally:
        sock.close(linger=0)
        ctx.term()
        assert srv.stop() == 0
