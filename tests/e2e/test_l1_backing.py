"""`--l1-backing`: the operator chooses whether engine-driven workers may map L1 (shm, one copy)
or not (private: they copy through the chunk pool); shm without room is refused at start."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from dataplane.client import WorkerAdapter
from dataplane.memory import shm
from tests.e2e.test_remote_tier import CS
from tests.helpers import ServerProcess, mounted_tmpfs, subprocess_env

LAYERS, BLOCKS, BS, HEADS, HD = 2, 32, 16, 2, 64


def round_trip(srv: ServerProcess) -> WorkerAdapter:
    caches = [torch.randn(2, BLOCKS, BS, HEADS, HD).to(torch.bfloat16) for _ in range(LAYERS)]
    want = [c.clone() for c in caches]
    w = WorkerAdapter(srv.endpoint, "m", transfer_mode="engine_driven", heartbeat_interval=5.0)
    w.register_kv_caches(caches)
    tokens, blocks = np.arange(512), np.arange(BLOCKS)
    assert w.store_detail(tokens, blocks).stored == 512 // CS
    for c in caches:
        c.zero_()
    assert w.retrieve(tokens, blocks) == 512
    assert all(
        torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(caches, want, strict=True)
    )
    return w


@pytest.mark.parametrize(("backing", "one_copy"), [("private", False), ("shm", True), ("auto", True)])
def test_backing_decides_whether_workers_map_l1(tmp_path: Path, backing: str, one_copy: bool) -> None:
    srv = ServerProcess(tmp_path, "--l1-backing", backing)
    try:
        srv.wait_ready()
        arena = httpx.get(f"http://127.0.0.1:{srv.http_port}/status").json()["storage"]["l1"]["arena"]
        assert arena["backing"] == ("shm" if one_copy else "private")
        w = round_trip(srv)
        try:
            assert (w._transport._arena is not None) == one_copy  # type: ignore[attr-defined]
            text = httpx.get(f"http://127.0.0.1:{srv.http_port}/metrics").text

            def ok(kind: str) -> float:
                m = re.search(rf'kvwarden_requests_total{{outcome="ok",type="{kind}"}} (\S+)', text)
                return float(m.group(1)) if m else 0.0

            assert (ok("ENGINE_RESERVE"), ok("ENGINE_COMMIT")) == ((1.0, 1.0) if one_copy else (0.0, 0.0))
            assert (ok("ENGINE_STORE"), ok("ENGINE_RETRIEVE")) == ((0.0, 0.0) if one_copy else (1.0, 1.0))
        finally:
            w.close()
    finally:
        srv.stop()


def test_shm_backing_without_room_is_refused_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with mounted_tmpfs("64m") as d:
        monkeypatch.setattr(shm, "SHM_DIR", d)
        srv = ServerProcess(tmp_path, "--l1-backing", "shm", env=subprocess_env(KVWARDEN_SHM_DIR=str(d)))
        assert srv.proc.wait(60) == 1
        assert f"cannot start: [Errno 28] l1_backing shm: {d} has" in srv.output()
        assert list(d.iterdir()) == []


def test_unknown_backing_is_a_usage_error(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path, "--l1-backing", "hugetlb")
    assert srv.proc.wait(60) == 2
    assert "l1_backing" in srv.output() and "auto" in srv.output()
