"""`--ipc-path`: the data plane on a Unix socket only the server's user can connect to."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dataplane.client import WorkerAdapter, allocate_kv_caches, free_kv_caches
from tests.conftest import ServerFactory
from tests.helpers import ROOT, subprocess_env, wait_until

# a PING from another user: it prints "answered" or "no answer" (its connect is refused)
_STRANGER = r"""
import os, sys, zmq
from dataplane.wire.messages import Ping
from dataplane.wire.protocol import encode_message
frame = encode_message(1, Ping(None, None))
ctx = zmq.Context()
os.setgid(65534); os.setuid(65534)  # everything imported first: the interpreter may be root's
s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0); s.connect(sys.argv[1])
s.send(frame)
print("answered" if s.poll(3000) else "no answer", flush=True)
"""


def test_serve_on_an_ipc_socket_of_its_user_only(make_server: ServerFactory, tmp_path: Path) -> None:
    sock_dir = tmp_path / "run"
    sock_dir.mkdir()
    sock_dir.chmod(0o755)  # the directory lets others in: only the socket's own mode keeps them out
    path = sock_dir / "kvwarden.sock"
    server = make_server("--ipc-path", str(path), "--chunk-size", "16", ready=False)
    endpoint = f"ipc://{path}"
    wait_until(path.exists, 30, what="the socket file")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.stat().st_uid == os.geteuid()

    caches = allocate_kv_caches(2, 8, 16, 2, 8, torch.bfloat16)
    w = WorkerAdapter(endpoint, "m", request_timeout=30.0)
    try:
        w.register_kv_caches(caches)
        tokens = np.arange(64)
        for c in caches:
            c[:, :4].normal_()
        assert w.store(tokens, np.arange(4))
        assert w.retrieve(tokens, np.arange(4, 8)) == 64
        assert all(torch.equal(c[:, :4], c[:, 4:8]) for c in caches)
    finally:
        w.close()
        free_kv_caches(caches)

    if os.geteuid() != 0:
        pytest.skip("trying the socket as another user needs root (to drop to uid 65534)")
    env = subprocess_env(PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", _STRANGER, endpoint], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.stdout.strip() == "no answer", out.stdout + out.stderr
    assert server.proc.poll() is None


def test_ipc_path_and_a_tcp_port_are_refused_together(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "serve", "--ipc-path", str(tmp_path / "s"), "--port", "6000"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=subprocess_env(),
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "ipc_path and host/port" in out.stderr and len(out.stderr.strip().splitlines()) == 1
