"""The file tier through the public contract: real `kvwarden serve` processes over a real
directory (and small tmpfs mounts), workers through `dataplane.client`, the sidecar over HTTP;
servers SIGKILLed and restarted, files damaged, directories removed and made read-only."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from tests.e2e.test_remote_tier import BLOCK_IDS, Worker, health, prompt, status
from tests.fuse_mount import FuseMount
from tests.helpers import ROOT, ServerProcess, dealer, mounted_tmpfs, ping, subprocess_env, wait_until
from tests.page_cache import drop_from_page_cache

INTERVAL, TIMEOUT = 0.3, 0.5  # health_ping_interval, health_ping_timeout and fs_timeout
CS = 256  # the chunk size these servers are given: the file sizes and caps below are counted in it


def serve(tmp: Path, fs: Path, *args: str, size_gb: str = "1", port: int = 0) -> ServerProcess:
    srv = ServerProcess(
        tmp,
        "--chunk-size",
        str(CS),
        "--fs-path",
        str(fs),
        "--fs-size-gb",
        size_gb,
        "--fs-timeout-seconds",
        str(TIMEOUT),
        "--health-ping-interval",
        str(INTERVAL),
        "--health-ping-timeout",
        str(TIMEOUT),
        *args,
        port=port,
    )
    srv.wait_ready()
    return srv


def fs_doc(srv: ServerProcess) -> dict[str, Any]:
    doc: dict[str, Any] = status(srv)["storage"]["fs"]
    return doc


def chunk_files(root: Path) -> list[Path]:
    return sorted(root.glob("kvwarden-v2/*/*/*/*.kv"))


def tmp_files(root: Path) -> list[Path]:
    return sorted(root.glob("kvwarden-v2/*/*/*/.*.tmp"))


def written(srv: ServerProcess, n: int) -> None:
    wait_until(lambda: fs_doc(srv)["puts"] >= n and fs_doc(srv)["queue_depth"] == 0, 20, what=f"{n} files")


def kill(srv: ServerProcess) -> None:
    srv.proc.send_signal(signal.SIGKILL)
    srv.proc.wait(10)


@pytest.mark.parametrize("mode", ["server_driven", "engine_driven"])
def test_chunks_survive_a_sigkill_and_are_hits_after_the_restart(tmp_path: Path, mode: str) -> None:
    root = tmp_path / "fs"
    root.mkdir()
    a = serve(tmp_path / "a", root)
    w = None
    try:
        w = Worker(a, mode)
        tokens = prompt(1, 3 * CS)
        want = w.fill(1)
        assert w.w.store_detail(tokens, BLOCK_IDS).stored == 3
        written(a, 3)
        files = chunk_files(root)
        assert len(files) == 3 and not tmp_files(root)
        scope_dirs = {f.parent.parent.parent.name for f in files}
        assert len(scope_dirs) == 1 and len(scope_dirs.pop()) == 32  # one directory per model scope
        doc = fs_doc(a)
        assert doc["files"] == 3 and doc["used_bytes"] == sum(f.stat().st_size for f in files)
        w.w.close()
        w = None
        kill(a)
        t0 = time.monotonic()
        b = serve(tmp_path / "b", root, port=a.port)
        a = b
        w = Worker(b, mode)
        w.blank()
        assert w.w.lookup(tokens) == 3 * CS
        assert w.w.retrieve(tokens, BLOCK_IDS) == 3 * CS
        took = time.monotonic() - t0
        assert w.same(want, 3 * CS)
        doc = fs_doc(b)
        assert doc["hits"] + doc["read_ahead"] >= 3 and doc["bad_files"] == 0
        assert took < 30, took
        wait_until(lambda: fs_doc(b)["rebuilt"], 20, what="the index rebuilt")
        assert fs_doc(b)["files"] == 3
        out = subprocess.run(
            [sys.executable, "-m", "app.cli", "status", "--url", f"http://127.0.0.1:{b.http_port}"],
            cwd=ROOT,
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        line = next(x for x in out.stdout.splitlines() if x.startswith("fs "))
        assert str(root) in line and "3 files" in line and "probe" in line and "BYPASSED" not in line, line
        text = httpx.get(f"http://127.0.0.1:{b.http_port}/metrics", timeout=10).text
        assert "kvwarden_fs_files 3.0" in text and "kvwarden_fs_rebuilt 1.0" in text
        assert 'kvwarden_fs_duration_seconds_count{op="get"}' in text
    finally:
        if w is not None:
            w.close()
        a.stop()


@contextlib.contextmanager
def two_servers(
    tmp_path: Path, *a_args: str
) -> Iterator[tuple[Path, ServerProcess, ServerProcess, Worker, Worker]]:
    """Servers A (with ``a_args``) and B on one directory (B's L1 cold to what A writes), a
    worker of each."""
    root = tmp_path / "fs"
    root.mkdir()
    a = serve(tmp_path / "a", root, *a_args)
    b = serve(tmp_path / "b", root)
    workers: list[Worker] = []
    try:
        workers += [Worker(a), Worker(b)]
        yield root, a, b, workers[0], workers[1]
    finally:
        for w in workers:
            w.close()
        a.stop()
        b.stop()


def test_a_lookup_reads_what_it_found_on_disk_into_l1_before_the_retrieve(tmp_path: Path) -> None:
    with two_servers(tmp_path) as (_, a, b, wa, wb):
        tokens = prompt(2, 4 * CS)
        want = wa.fill(2)
        assert wa.w.store_detail(tokens, BLOCK_IDS).stored == 4
        written(a, 4)
        assert status(b)["storage"]["l1"]["chunks"] == 0
        assert wb.w.lookup(tokens) == 4 * CS  # B's index never saw them: found by stat
        wait_until(lambda: status(b)["storage"]["l1"]["chunks"] == 4, 10, what="the read-ahead")
        assert fs_doc(b)["read_ahead"] == 4
        assert wb.w.retrieve(tokens, BLOCK_IDS) == 4 * CS and wb.same(want, 4 * CS)
        assert fs_doc(b)["hits"] == 4  # read once, by the read-ahead: not again


def test_a_retrieve_reads_warm_files_in_place_and_cold_ones_through_l1(tmp_path: Path) -> None:
    with two_servers(tmp_path) as (root, a, b, wa, wb):
        tokens = prompt(3, 4 * CS)
        want = wa.fill(3)
        by_chunk: list[Path] = []
        for n in range(1, 5):  # a chunk at a time, to know which file is which
            assert wa.w.store_detail(tokens[: n * CS], BLOCK_IDS).stored == 1
            written(a, n)
            (new,) = set(chunk_files(root)) - set(by_chunk)
            by_chunk.append(new)
        for f in by_chunk:
            f.read_bytes()  # warm
        drop_from_page_cache(by_chunk[2])  # but for the third
        assert wb.w.retrieve(tokens, BLOCK_IDS) == 4 * CS and wb.same(want, 4 * CS)
        doc = fs_doc(b)
        assert doc["hits"] == 4 and doc["read_in_place"] == 2 and doc["bad_files"] == 0, doc
        wait_until(lambda: fs_doc(b)["promoted"] == 2, 10, what="the chunks read in place to reach L1")
        assert status(b)["storage"]["l1"]["chunks"] == 4
        wb.blank()
        assert wb.w.retrieve(tokens, BLOCK_IDS) == 4 * CS and wb.same(want, 4 * CS)  # from L1 now
        assert fs_doc(b)["hits"] == 4
        text = httpx.get(f"http://127.0.0.1:{b.http_port}/metrics", timeout=10).text
        assert "kvwarden_fs_read_in_place_total 2.0" in text and "kvwarden_fs_promoted_total 2.0" in text


def test_coded_files_are_smaller_and_read_back_bit_for_bit_never_in_place(tmp_path: Path) -> None:
    """A writes with ``--fs-compression lossless``: its files take fewer bytes than B's raw
    ones would; B, which does not code, retrieves them warm from the page cache, decoded, bit for
    bit, none in place."""
    with two_servers(tmp_path, "--fs-compression", "lossless") as (root, a, b, wa, wb):
        tokens = prompt(4, 4 * CS)
        want = wa.fill(4)  # (random bfloat16: its exponent bytes code to about 1.5x)
        assert wa.w.store_detail(tokens, BLOCK_IDS).stored == 4
        written(a, 4)
        doc = fs_doc(a)
        raw = 2 * 2 * CS * 2 * 64 * 2  # layers x K/V x tokens x heads x head_dim x 2 bytes
        assert doc["coded_puts"] == 4 and doc["coded_bytes_saved"] > 4 * raw // 4, doc
        files = chunk_files(root)
        assert len(files) == 4 and all(f.stat().st_size < raw * 0.8 for f in files)
        for f in files:
            f.read_bytes()  # warm: in place would be tried for a raw file
        assert wb.w.retrieve(tokens, BLOCK_IDS) == 4 * CS and wb.same(want, 4 * CS)
        doc = fs_doc(b)
        assert doc["hits"] == 4 and doc["read_in_place"] == 0 and doc["bad_files"] == 0, doc
        text = httpx.get(f"http://127.0.0.1:{a.http_port}/metrics", timeout=10).text
        assert "kvwarden_fs_coded_writes_total 4.0" in text


def test_damaged_truncated_and_foreign_files_are_counted_removed_and_never_served(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    root.mkdir()
    a = serve(tmp_path / "a", root)
    b = serve(tmp_path / "b", root)  # the reader: its L1 never held these prompts
    wa = wb = None
    try:
        wa, wb = Worker(a), Worker(b)
        files: list[tuple[Path, Path]] = []  # each prompt's (chunk 0, chunk 1)
        wants = []
        for n in range(4):
            tokens = prompt(30 + n, 2 * CS)
            wants.append(wa.fill(30 + n))
            before = set(chunk_files(root))
            assert wa.w.store_detail(tokens[:CS], BLOCK_IDS).stored == 1
            written(a, 2 * n + 1)
            (f0,) = set(chunk_files(root)) - before
            assert wa.w.store_detail(tokens, BLOCK_IDS).stored == 1
            written(a, 2 * n + 2)
            (f1,) = set(chunk_files(root)) - before - {f0}
            files.append((f0, f1))
        other = files[3][1].read_bytes()  # another key's file, whole
        v0, v1 = files[0][0].read_bytes(), files[3][1].read_bytes()
        flipped = bytearray(v1)
        flipped[len(flipped) // 2] ^= 0x01
        cases = [  # (chunk 0's file, chunk 1's file or None: unchanged), tokens served, the kind
            (v0[: len(v0) // 2], None, 0, "truncated"),
            (other, None, 0, "key"),
            (b"not ours at all" * 10, None, 0, "format"),
            (None, bytes(flipped), CS, "checksum"),  # chunk 1 damaged: only chunk 0 is served
        ]
        for n, (c0, c1, served, kind) in enumerate(cases):
            f0, f1 = files[n]
            if c0 is not None:
                f0.write_bytes(c0)
            if c1 is not None:
                f1.write_bytes(c1)
            wb.blank()
            assert wb.w.retrieve(prompt(30 + n, 2 * CS), BLOCK_IDS) == served, kind
            assert wb.same(wants[n], served)
            wait_until(lambda n=n: fs_doc(b)["bad_files"] == n + 1, 10, what=f"the {kind} file counted")
            damaged = f1 if served else f0
            wait_until(lambda d=damaged: not d.exists(), 10, what=f"the {kind} file removed")
            text = httpx.get(f"http://127.0.0.1:{b.http_port}/metrics", timeout=10).text
            assert f'kvwarden_fs_bad_files_total{{kind="{kind}"}} 1.0' in text, kind
    finally:
        for w in (wa, wb):
            if w is not None:
                w.close()
        a.stop()
        b.stop()


@pytest.mark.parametrize("policy", ["lru", "lfuda"])
def test_the_cap_holds_while_serving_and_across_a_restart_with_a_smaller_one(
    tmp_path: Path, policy: str
) -> None:
    """Files only stored (none read): either order removes the oldest first."""
    root = tmp_path / "fs"
    root.mkdir()
    chunk = 256 << 10  # the test worker's chunk: 2 layers x 2 x 2 heads x 64 x bf16 x 256 tokens
    cap_gb = f"{6.5 * chunk / (1 << 30):.9f}"  # room for 6 files (each a header more than a chunk)
    srv = serve(tmp_path / "a", root, "--fs-eviction", policy, size_gb=cap_gb)
    w = None
    try:
        assert fs_doc(srv)["policy"] == policy
        w = Worker(srv)
        for seed in range(5):  # 10 chunks, 2 a prompt
            w.fill(seed)
            assert w.w.store_detail(prompt(100 + seed, 2 * CS), BLOCK_IDS).stored == 2
        written(srv, 10)
        files = chunk_files(root)
        cap = int(float(cap_gb) * (1 << 30))
        assert len(files) == 6 and sum(f.stat().st_size for f in files) <= cap
        assert fs_doc(srv)["evictions"] == 4
        first = prompt(100, 2 * CS)  # the oldest: evicted
        last = prompt(104, 2 * CS)
        srv.stop()
        small = f"{3.5 * chunk / (1 << 30):.9f}"
        srv = serve(tmp_path / "b", root, "--fs-eviction", policy, size_gb=small)
        wait_until(lambda: fs_doc(srv)["rebuilt"], 20, what="the rebuild")
        files = chunk_files(root)
        assert len(files) == 3 and sum(f.stat().st_size for f in files) <= int(float(small) * (1 << 30))
        w.w.close()
        w = Worker(srv)
        assert w.w.lookup(first) == 0
        assert w.w.lookup(last) == 2 * CS  # the newest stayed
    finally:
        if w is not None:
            w.close()
        srv.stop()


def test_a_sigkill_during_writes_leaves_no_partial_file_and_stale_temporaries_are_swept(
    tmp_path: Path,
) -> None:
    root = tmp_path / "fs"
    root.mkdir()
    srv = serve(tmp_path / "a", root)
    w = None
    try:
        w = Worker(srv)
        for seed in range(6):
            w.fill(seed)
            w.w.store_detail(prompt(200 + seed, 4 * CS), BLOCK_IDS)
        kill(srv)  # some writes were queued or under way
        w.close()
        w = None
        # a temporary file a writer on this host left behind (its process is gone)
        leaf = root / "kvwarden-v2" / ("ab" * 16) / "ab" / "cd"
        leaf.mkdir(parents=True)
        dead = subprocess.Popen(["true"])
        dead.wait()
        stale = leaf / f".{'ab' * 16}.kv.{os.uname().nodename.replace('.', '_')}.{dead.pid}.0a0b0c0d0e0f.tmp"
        stale.write_bytes(b"half a chunk")
        srv = serve(tmp_path / "b", root)
        wait_until(lambda: fs_doc(srv)["rebuilt"], 20, what="the rebuild")
        assert not stale.exists()
        w = Worker(srv)
        for seed in range(6):  # every file there is whole: each prompt is a hit of a prefix, or a miss
            w.fill(seed)
            want = [c.clone() for c in w.caches]
            w.blank()
            got = w.w.retrieve(prompt(200 + seed, 4 * CS), BLOCK_IDS)
            assert got % CS == 0 and w.same(want, got)
        assert fs_doc(srv)["bad_files"] == 0
    finally:
        if w is not None:
            w.close()
        srv.stop()


def test_no_space_is_counted_and_nothing_breaks(tmp_path: Path) -> None:
    with mounted_tmpfs("600k") as root:
        srv = serve(tmp_path / "a", root, "--fallback-policy", "local_cpu")
        w = None
        try:
            w = Worker(srv)
            tokens = prompt(5, 4 * CS)  # 1 MiB of chunks on a 600 KiB file system
            want = w.fill(5)
            assert w.w.store_detail(tokens, BLOCK_IDS).stored == 4
            wait_until(lambda: fs_doc(srv)["put_failures"] >= 1, 20, what="a write refused: no space")
            text = httpx.get(f"http://127.0.0.1:{srv.http_port}/metrics", timeout=10).text
            assert 'kvwarden_fs_failures_total{kind="no_space",op="put"}' in text
            assert not tmp_files(root)  # a failed write leaves nothing behind
            w.blank()
            assert w.w.retrieve(tokens, BLOCK_IDS) == 4 * CS and w.same(want, 4 * CS)  # L1 still serves
        finally:
            if w is not None:
                w.close()
            srv.stop()


def test_a_directory_made_read_only_then_removed_while_serving(tmp_path: Path) -> None:
    with mounted_tmpfs("16m") as mount:
        root = mount / "fs"
        root.mkdir()
        srv = serve(
            tmp_path / "a", root, "--fallback-policy", "local_cpu", "--waiting-time-for-recovery", "0"
        )
        w = None

        def bypassed(on: bool) -> None:
            wait_until(lambda: fs_doc(srv)["bypassed"] is on, 10, interval=0.05, what=f"bypassed={on}")

        try:
            w = Worker(srv)
            tokens = prompt(6, 2 * CS)
            want = w.fill(6)
            assert w.w.store_detail(tokens, BLOCK_IDS).stored == 2
            written(srv, 2)
            assert health(srv) == (200, "pass")
            subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True, timeout=30)
            try:
                bypassed(True)
                check = next(c for c in status(srv)["health"]["checks"] if c["name"].startswith("fs_tier:"))
                assert check["status"] == "warn" and "probe" in check["output"]
                assert health(srv)[0] == 200  # local_cpu: still serving
                w.fill(7)
                assert w.w.store_detail(prompt(7, 2 * CS), BLOCK_IDS).stored == 2  # into L1
                w.blank()
                assert w.w.retrieve(tokens, BLOCK_IDS) == 2 * CS and w.same(want, 2 * CS)
            finally:
                subprocess.run(["mount", "-o", "remount,rw", str(mount)], check=True, timeout=30)
            bypassed(False)
            shutil.rmtree(root)
            bypassed(True)
            assert not root.exists()  # never re-created on the disk beneath a mount point
            assert srv.proc.poll() is None and health(srv)[0] == 200
            root.mkdir()
            bypassed(False)
            w.fill(8)
            puts = fs_doc(srv)["puts"]
            assert w.w.store_detail(prompt(8, 2 * CS), BLOCK_IDS).stored == 2
            written(srv, puts + 2)
            assert len(chunk_files(root)) == 2
        finally:
            if w is not None:
                w.close()
            srv.stop()


@pytest.mark.parametrize("policy", ["local_cpu", "recompute"])
def test_a_mount_that_stops_answering_never_stalls_requests(tmp_path: Path, policy: str) -> None:
    mount = FuseMount(tmp_path / "backing", tmp_path / "mnt")  # a real mount, its server frozen below
    srv = serve(tmp_path / "a", tmp_path / "mnt", "--fallback-policy", policy)
    ctx: zmq.Context[Any] = zmq.Context()
    sock = dealer(ctx, srv.endpoint)
    w = None
    try:
        w = Worker(srv)
        stored = prompt(10, 2 * CS)
        want = w.fill(10)
        assert w.w.store_detail(stored, BLOCK_IDS).stored == 2
        written(srv, 2)
        mount.freeze()  # every call into the mount now blocks in the kernel
        t0 = time.monotonic()
        ping(sock)
        w.fill(11)
        # (the health check needs health_ping_timeout to call the tier stuck: these come first)
        assert w.w.store_detail(prompt(11, 2 * CS), BLOCK_IDS).stored == 2  # the write waits, not the STORE
        w.blank()
        assert w.w.retrieve(stored, BLOCK_IDS) == 2 * CS and w.same(want, 2 * CS)  # L1 still serves
        assert w.w.lookup(prompt(12, 2 * CS)) == 0  # its stat passes the deadline: a miss
        assert time.monotonic() - t0 < 5 * TIMEOUT
        if policy == "local_cpu":
            wait_until(lambda: fs_doc(srv)["bypassed"], 10, interval=0.05, what="the tier bypassed")
            assert health(srv)[0] == 200
        else:
            wait_until(lambda: health(srv)[0] == 503, 10, interval=0.05, what="the server unhealthy")
        check = next(c for c in status(srv)["health"]["checks"] if c["name"].startswith("fs_tier:"))
        assert check["output"].startswith("the probe file did not round-trip in time"), check
        assert fs_doc(srv)["stalled_seconds"] > TIMEOUT
        t1 = time.monotonic()
        for _ in range(20):
            ping(sock)
        assert time.monotonic() - t1 < 2  # the loop never waits on the disk
        mount.thaw()
        wait_until(lambda: health(srv) == (200, "pass"), 20, interval=0.05, what="the tier back")
        assert not fs_doc(srv)["bypassed"]
        w.fill(13)
        puts = fs_doc(srv)["puts"]
        assert w.w.store_detail(prompt(13, 2 * CS), BLOCK_IDS).stored == 2
        written(srv, puts + 2)
    finally:
        mount.thaw()
        sock.close(linger=0)
        ctx.term()
        if w is not None:
            w.close()
        assert srv.stop() == 0
        mount.close()
