"""Asynchronous loads (vLLM's ``load_kv_async``) that go wrong, with real vLLM engine processes
(vLLM's CPU build, from ``.venv-vllm``) and a real ``kvwarden serve`` whose file tier holds the
prompt's chunks (the server restarted: L1 empty, the chunks on disk only).

- A load that fails mid-way (a chunk file damaged after the LOOKUP counted it) fills what it
  could, names the rest, and vLLM recomputes them: the output is the reference's, token for
  token, and vLLM says it rescheduled the request for the tokens of the chunks not loaded.
- An engine SIGKILLed while its load waits on a disk that stopped answering (a FUSE mount whose
  server is frozen): the server stays up and answers, the engine's worker is reaped by its
  disconnect, and once the disk answers again a new engine loads the prompt whole.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvbench.procs import free_port
from kvbench.vllm import EngineProcess
from tests.e2e.vllm_support import (
    CHUNK,
    FULL,
    PROMPT,
    Reference,
    engine,
    instances,
    l1_chunks,
    reaped,
)
from tests.fuse_mount import FuseMount
from tests.helpers import ServerProcess, wait_until

pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("vllm")]  # one worker: the vLLM engines

PAYLOAD_AT = 4096  # where a chunk file's bytes start (dataplane.storage.fs.layout)


def serve(tmp: Path, fs: Path, port: int, http_port: int, *args: str) -> ServerProcess:
    srv = ServerProcess(
        tmp,
        "--chunk-size",
        str(CHUNK),
        "--l1-size-gb",
        "0.5",
        "--worker-disconnect-grace-seconds",
        "2",
        "--fs-path",
        str(fs),
        "--fs-size-gb",
        "1",
        *args,
        port=port,
        http_port=http_port,
    )
    srv.wait_ready()
    return srv


def fs_doc(srv: ServerProcess) -> dict[str, Any]:
    doc: dict[str, Any] = httpx.get(f"http://127.0.0.1:{srv.http_port}/status", timeout=10).json()
    return doc["storage"]["fs"]  # type: ignore[no-any-return]


def chunk_files(root: Path) -> list[Path]:
    """The chunk files under ``root``, in the order they were written."""
    return sorted(root.glob("kvwarden-v2/*/*/*/*.kv"), key=lambda f: f.stat().st_mtime_ns)


class Setup:
    """A server whose file tier holds PROMPT's 4 full chunks, restarted so that L1 holds none."""

    def __init__(self, ref: Reference, tmp: Path, fs: Path, *args: str) -> None:
        self.ref, self.tmp, self.fs, self.args = ref, tmp, fs, args
        self.port, self.http_port = free_port(), free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.engines: list[EngineProcess] = []
        self.srv = self.serve()

    def serve(self) -> ServerProcess:
        srv = serve(self.tmp / f"server-{free_port()}", self.fs, self.port, self.http_port, *self.args)
        self.srv = srv
        return srv

    def engine(self, **extra: float) -> EngineProcess:
        eng = engine(self.ref.models.model, self.endpoint, self.tmp, extra)
        self.engines.append(eng)
        return eng

    def store_prompt_on_disk(self) -> None:
        eng = self.engine()
        out = eng.generate(PROMPT)  # a miss: stores the prompt's full chunks, to L1 and to disk
        assert out["tokens"] == self.ref.tokens["prompt"] and out["cached"] == 0
        wait_until(lambda: fs_doc(self.srv)["puts"] == 4, 60, 0.2, what="4 chunk files written")
        eng.close()
        self.srv.stop()
        self.serve()  # L1 empty: the chunks are on disk only
        wait_until(lambda: fs_doc(self.srv)["rebuilt"], 30, 0.2, what="the index rebuilt")
        assert fs_doc(self.srv)["files"] == 4 and l1_chunks(self.srv) == 0

    def close(self) -> None:
        for eng in self.engines:
            eng.kill()
        self.srv.stop()


@pytest.fixture
def on_disk(reference: Reference, tmp_path: Path) -> Iterator[Setup]:
    fs = tmp_path / "fs"
    fs.mkdir()
    s = Setup(reference, tmp_path, fs)
    try:
        s.store_prompt_on_disk()
        yield s
    finally:
        s.close()


def test_a_load_that_fails_mid_way_is_recomputed_from_where_it_failed(on_disk: Setup) -> None:
    files = chunk_files(on_disk.fs)
    assert len(files) == 4
    with open(files[2], "r+b") as f:  # the third chunk's bytes damaged: it fails its check
        f.seek(PAYLOAD_AT + 1000)
        b = f.read(1)
        f.seek(PAYLOAD_AT + 1000)
        f.write(bytes([b[0] ^ 0xFF]))
    eng = on_disk.engine()  # (vLLM logs to its log file: EngineProcess)
    out = eng.generate(PROMPT)
    assert out["tokens"] == on_disk.ref.tokens["prompt"], out  # the reference's, token for token
    doc = fs_doc(on_disk.srv)
    assert doc["bad_files"] == 1 and doc["hits"] + doc["read_ahead"] >= 2  # refused, never served
    # the load named the blocks of the last two chunks: vLLM recomputed them (its own words)
    log = eng.log.read_text(errors="replace")
    assert f"1 request(s) rescheduled ({2 * CHUNK} tokens affected)" in log, log[-3000:]


def test_an_engine_killed_while_its_load_waits_on_a_stuck_disk(reference: Reference, tmp_path: Path) -> None:
    mount = FuseMount(tmp_path / "backing", tmp_path / "mnt")  # a real mount, its server frozen below
    s = None
    try:
        s = Setup(
            reference,
            tmp_path,
            mount.mountpoint,
            "--fs-timeout-seconds",
            "20",
            "--health-ping-interval",
            "0.5",
        )
        s.store_prompt_on_disk()
        kept = s.engine()  # an engine of its own, registered before the disk stops answering
        wait_until(lambda: len(instances(s.srv)) == 1, 60, 0.2, what="the engine to register")
        (kept_id,) = [i["instance_id"] for i in instances(s.srv)]
        victim = s.engine()
        wait_until(lambda: len(instances(s.srv)) == 2, 60, 0.2, what="the second engine to register")
        mount.freeze()
        answers: list[Any] = []
        asking = threading.Thread(target=lambda: answers.append(_generate(victim)), daemon=True)
        asking.start()
        # the LOOKUP answers from the index; the load waits on the frozen disk
        wait_until(lambda: fs_doc(s.srv)["stalled_seconds"] > 1.0, 60, 0.2, what="a disk call stuck")
        victim.kill()
        asking.join(60)
        assert answers and isinstance(answers[0], Exception)  # it died while it loaded
        wait_until(
            lambda: [i["instance_id"] for i in instances(s.srv)] == [kept_id],
            30,
            0.2,
            what="the killed engine's worker to be reaped",
        )
        assert reaped(s.srv).get("disconnect") == 1
        assert s.srv.proc.poll() is None
        mount.thaw()
        wait_until(lambda: _health(s.srv) == (200, "pass"), 60, 0.2, what="the file tier healthy again")
        out = kept.generate(PROMPT)  # the disk answers again: the prompt loads whole
        assert out["tokens"] == reference.tokens["prompt"] and out["cached"] == FULL, out
    finally:
        if s is not None:
            s.close()
        mount.close()


def _health(srv: ServerProcess) -> tuple[int, str]:
    r = httpx.get(f"http://127.0.0.1:{srv.http_port}/health", timeout=10)
    return r.status_code, str(r.json()["status"])


def _generate(eng: EngineProcess) -> Any:
    try:
        return eng.generate(PROMPT, timeout=120)
    except Exception as exc:  # (its process killed under it)
        return exc
