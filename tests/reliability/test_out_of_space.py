"""Out of space is not an outage, through the public contract: a real `kvwarden serve` whose file
tier sits on a real file system that other data filled (a tmpfs this test mounts and fills;
skipped only where mounting is not permitted), and one whose remote tier is a real redis-server
at ``maxmemory 1mb`` with ``noeviction``. Workers store and read back through `dataplane.client`;
operators read `/health`, `/status` and `/metrics`.

Under the default ``fallback_policy=recompute``: every prompt stored is served back whole from
L1 (100%), byte for byte; the server stays healthy (`/health` 200 ``warn``, the tier's check
saying why); a restarted server still serves what the full tier holds, and nothing it never
wrote; writes resume once space frees.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import torch

from tests.e2e.test_remote_tier import BLOCK_IDS, CS, Worker, health, prompt, status
from tests.helpers import ROOT, ServerProcess, mounted_tmpfs, subprocess_env, wait_until
from tests.helpers import fill_filesystem as fill
from tests.redis_server import RedisServer

INTERVAL, TIMEOUT = 0.3, 0.5  # health_ping_interval, health_ping_timeout and the tiers' timeouts
PROMPT = 4 * CS  # tokens a prompt: 4 chunks of 256 KiB
MiB = 1 << 20


def serve(tmp: Path, *args: str, port: int = 0) -> ServerProcess:
    srv = ServerProcess(
        tmp,
        "--l1-size-gb",
        "0.3",
        "--health-ping-interval",
        str(INTERVAL),
        "--health-ping-timeout",
        str(TIMEOUT),
        *args,
        port=port,
    )
    srv.wait_ready()
    return srv


def check(srv: ServerProcess, prefix: str) -> dict[str, Any]:
    (c,) = [c for c in status(srv)["health"]["checks"] if c["name"].startswith(prefix)]
    return c  # type: ignore[no-any-return]


def warns(srv: ServerProcess) -> None:
    """Wait for a health round to report the tier out of space: 200 ``warn``, healthy."""
    wait_until(lambda: health(srv) == (200, "warn"), 10, what="/health: 200 warn")
    assert status(srv)["is_healthy"] is True


def cli_line(srv: ServerProcess, prefix: str) -> str:
    """The line of `kvwarden status` that starts with ``prefix``."""
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "status", "--url", f"http://127.0.0.1:{srv.http_port}"],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    return next(x for x in out.stdout.splitlines() if x.startswith(prefix))


def metrics(srv: ServerProcess) -> str:
    return httpx.get(f"http://127.0.0.1:{srv.http_port}/metrics", timeout=10).text


def store_all(w: Worker, seeds: range) -> dict[int, list[torch.Tensor]]:
    wants = {}
    for s in seeds:
        wants[s] = w.fill(s)
        assert w.w.store_detail(prompt(s, PROMPT), BLOCK_IDS).stored == 4
    return wants


def read_back(w: Worker, wants: dict[int, list[torch.Tensor]]) -> dict[int, int]:
    """Each prompt read back into blank blocks: the tokens served, each checked byte for byte."""
    got = {}
    for s, want in wants.items():
        w.blank()
        n = w.w.retrieve(prompt(s, PROMPT), BLOCK_IDS)
        assert n % CS == 0 and w.same(want, n), f"prompt {s}: {n} tokens served, not the ones stored"
        got[s] = n
    return got


def test_a_full_disk_under_the_file_tier_is_not_an_outage(tmp_path: Path) -> None:
    with mounted_tmpfs("24m") as mount:
        root = mount / "fs"
        root.mkdir()
        filler = fill(mount, 8 * MiB)  # the cap (1 GiB) is not what runs out: the disk is
        fs_args = ("--fs-path", str(root), "--fs-size-gb", "1", "--fs-timeout-seconds", str(TIMEOUT))
        srv = serve(tmp_path / "a", *fs_args)
        w = None
        try:
            w = Worker(srv)
            wants = store_all(w, range(30))  # 30 MiB of chunks onto 8 MiB of free disk
            wait_until(lambda: status(srv)["storage"]["fs"]["space"]["out_of_space"], 20, what="out of space")
            wait_until(lambda: status(srv)["storage"]["fs"]["queue_depth"] == 0, 20, what="queue drained")
            assert read_back(w, wants) == dict.fromkeys(range(30), PROMPT)  # all 30 from L1

            warns(srv)
            fs_check = check(srv, "fs_tier:")
            assert fs_check["status"] == "warn" and "out of space" in fs_check["output"], fs_check
            doc = status(srv)["storage"]["fs"]
            assert doc["space"]["episodes"] == 1 and "ENOSPC" in doc["space"]["reason"], doc["space"]
            assert doc["space"]["dropped_writes"] > 0 and doc["bad_files"] == 0
            on_disk = doc["files"]
            assert 0 < on_disk < 120 and doc["puts"] == on_disk
            text = metrics(srv)
            assert "kvwarden_fs_out_of_space 1.0" in text and "kvwarden_healthy 1.0" in text
            assert "OUT OF SPACE" in cli_line(srv, "fs ")
            assert 'kvwarden_fs_dropped_writes_total{reason="no_space"}' in text
            assert srv.proc.poll() is None
            w.close()
            w = None
            assert srv.stop() == 0

            # a restart on the still-full disk: what the tier holds is served, and nothing else
            srv = serve(tmp_path / "b", *fs_args, port=srv.port)
            w = Worker(srv)
            served = read_back(w, wants)
            assert sum(served.values()) == on_disk * CS, (served, on_disk)  # every file, once
            assert served[0] == PROMPT  # the first prompts were written whole before the disk filled
            assert health(srv)[0] == 200  # (warn once a write, or a probe, finds the disk full)
            store_all(w, range(30, 32))  # a write finds the disk full: this server learns it too
            wait_until(lambda: status(srv)["storage"]["fs"]["space"]["out_of_space"], 20, what="out of space")
            warns(srv)

            filler.unlink()  # space frees: the next health round resumes writes
            wait_until(
                lambda: not status(srv)["storage"]["fs"]["space"]["out_of_space"], 20, what="writes resume"
            )
            wait_until(lambda: health(srv) == (200, "pass"), 10, what="/health: 200 pass")
            puts = status(srv)["storage"]["fs"]["puts"]
            wants = store_all(w, range(100, 102))
            wait_until(lambda: status(srv)["storage"]["fs"]["puts"] >= puts + 8, 20, what="8 files written")
            assert read_back(w, wants) == {100: PROMPT, 101: PROMPT}
        finally:
            if w is not None:
                w.close()
            srv.stop()


def test_redis_out_of_memory_is_not_an_outage(tmp_path: Path) -> None:
    r = RedisServer()
    srv = None
    w = None
    try:
        args = ("--remote-url", r.url, "--remote-timeout-seconds", str(TIMEOUT))
        srv = serve(tmp_path / "a", *args)
        w = Worker(srv)
        before = store_all(w, range(2))  # written to Redis while it has room
        wait_until(lambda: status(srv)["storage"]["remote"]["puts"] >= 8, 20, what="8 chunks in Redis")
        with r.client() as c:  # Redis fills: maxmemory 1mb, noeviction
            c.config_set("maxmemory-policy", "noeviction")
            c.config_set("maxmemory", "1mb")
        wants = store_all(w, range(2, 12))
        wait_until(lambda: status(srv)["storage"]["remote"]["space"]["out_of_space"], 20, what="OOM seen")
        wait_until(lambda: status(srv)["storage"]["remote"]["queue_depth"] == 0, 20, what="queue drained")
        assert read_back(w, before | wants) == dict.fromkeys(range(12), PROMPT)  # all from L1

        warns(srv)
        remote_check = check(srv, "remote_backend:")
        assert remote_check["status"] == "warn" and "out of space" in remote_check["output"]
        doc = status(srv)["storage"]["remote"]
        assert doc["space"]["episodes"] == 1 and "OOM" in doc["space"]["reason"]
        assert doc["puts"] == 8 and doc["dropped_writes"] == 40 and doc["get_failures"] == 0
        text = metrics(srv)
        assert 'kvwarden_remote_out_of_space{backend="redis"} 1.0' in text
        assert "OUT OF SPACE" in cli_line(srv, "remote ")
        assert 'kvwarden_remote_failures_total{backend="redis",kind="no_space",op="put"} 1.0' in text
        w.close()
        w = None
        assert srv.stop() == 0

        # a fresh server: Redis, still full, serves what it holds (reads go on), and nothing else
        srv = serve(tmp_path / "b", *args, port=srv.port)
        w = Worker(srv)
        served = read_back(w, before | wants)
        assert served == {s: PROMPT if s < 2 else 0 for s in range(12)}
        assert status(srv)["storage"]["remote"]["hits"] == 8
        assert health(srv)[0] == 200

        srv_now = srv
        more = store_all(w, range(20, 21))  # refused by Redis: this server learns it is full too
        wait_until(lambda: status(srv_now)["storage"]["remote"]["space"]["out_of_space"], 20, what="OOM")
        with r.client() as c:
            c.config_set("maxmemory", "0")  # room again
        resumed = lambda: not status(srv_now)["storage"]["remote"]["space"]["out_of_space"]  # noqa: E731
        wait_until(resumed, 20, what="writes resume")
        wait_until(lambda: health(srv_now) == (200, "pass"), 10, what="/health: 200 pass")
        puts = status(srv)["storage"]["remote"]["puts"]
        more = store_all(w, range(21, 22))
        wait_until(lambda: status(srv_now)["storage"]["remote"]["puts"] >= puts + 4, 20, what="4 writes")
        assert read_back(w, more) == {21: PROMPT}
    finally:
        if w is not None:
            w.close()
        if srv is not None:
            srv.stop()
        r.stop()
