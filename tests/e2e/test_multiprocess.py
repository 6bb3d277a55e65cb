"""End to end with real processes: one server, worker processes sharing KV through it."""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from dataplane.memory import shm
from dataplane.memory.shm import owner_alive
from tests.e2e.workers import LAYOUT, WorkerProcess, token_bytes_per_token
from tests.helpers import ServerProcess, subprocess_env

CHUNK = 32
BS = LAYOUT["block_size"]
TPB = token_bytes_per_token()


def rand_tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, n).tolist()


def rand_blocks(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).permutation(LAYOUT["blocks"])[:n].tolist()


def kvwarden_segments_of(directory: Path, pids: set[int]) -> list[str]:
    out = []
    for p in directory.iterdir():
        m = re.match(r"^kvwarden-(\d+)-", p.name)
        if m and int(m.group(1)) in pids:
            out.append(p.name)
    return out


@dataclass
class Cluster:
    server: ServerProcess
    a: WorkerProcess  # random cache: the producer
    b: WorkerProcess  # zeroed cache, same model: the consumer
    c: WorkerProcess  # zeroed cache, another model
    tmp: Path
    prompt: list[int]  # 5 full chunks and a partial one
    blocks_a: list[int]
    blocks_b: list[int]
    store_result: dict[str, int]
    expected: bytes  # A's token-major bytes of the 5 stored chunks

    def expected_prefix(self, n: int) -> bytes:
        return self.a.dump(self.blocks_a, n, self.tmp / f"a-{n}.bin")


def start_workers(tmp: Path, endpoint: str, *specs: tuple[str, dict[str, object]]) -> list[WorkerProcess]:
    workers = [WorkerProcess(tmp, endpoint, name, **kw) for name, kw in specs]  # type: ignore[arg-type]
    try:
        for w in workers:
            w.wait_ready()
    except BaseException:
        for w in workers:
            w.stop()
        raise
    return workers


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("cluster")
    server = ServerProcess(tmp, "--chunk-size", str(CHUNK), "--l1-size-gb", "0.05")
    workers: list[WorkerProcess] = []
    try:
        server.wait_ready()
        workers = start_workers(
            tmp,
            server.endpoint,
            ("A", {"fill": "random", "seed": 1}),
            ("B", {"fill": "zero"}),
            ("C", {"fill": "zero", "model": "other-model"}),
        )
        a, b, c = workers
        prompt = rand_tokens(10, 5 * CHUNK + 10)
        blocks_a = rand_blocks(11, -(-len(prompt) // BS))
        blocks_b = rand_blocks(12, len(blocks_a))
        assert blocks_a != blocks_b
        result = a.store(prompt, blocks_a)
        expected = a.dump(blocks_a, 5 * CHUNK, tmp / "a-expected.bin")
        yield Cluster(server, a, b, c, tmp, prompt, blocks_a, blocks_b, result, expected)
        for w in workers:
            assert w.close() == 0, w.stderr()
    finally:
        for w in workers:
            w.stop()
        rc = server.stop()
    assert rc == 0, server.output()
    assert "Traceback" not in server.output(), server.output()


def test_store_reports_every_full_chunk(cluster: Cluster) -> None:
    assert cluster.store_result == {"chunks": 5, "stored": 5, "present": 0, "rejected": 0, "skipped": 0}
    assert len(cluster.expected) == 5 * CHUNK * TPB
    assert any(cluster.expected), "worker A's cache should hold random data"


def test_retrieve_in_another_process_is_byte_equal(cluster: Cluster) -> None:
    b = cluster.b
    assert b.lookup(cluster.prompt) == 5 * CHUNK
    out = cluster.tmp / "b-full.bin"
    assert b.retrieve(cluster.prompt, cluster.blocks_b, out) == 5 * CHUNK
    assert out.read_bytes() == cluster.expected


def test_store_again_finds_everything_present(cluster: Cluster) -> None:
    assert cluster.a.store(cluster.prompt, cluster.blocks_a) == {
        "chunks": 5,
        "stored": 0,
        "present": 5,
        "rejected": 0,
        "skipped": 0,
    }


def test_same_model_other_instance_shares_chunks(cluster: Cluster) -> None:
    # B's blocks hold other bytes; its STORE must not replace what A stored
    blocks = rand_blocks(13, len(cluster.blocks_a))
    assert cluster.b.store(cluster.prompt, blocks)["present"] == 5
    out = cluster.tmp / "b-after-own-store.bin"
    assert cluster.b.retrieve(cluster.prompt, cluster.blocks_b, out) == 5 * CHUNK
    assert out.read_bytes() == cluster.expected


def test_stored_prefix_plus_other_tail_hits_the_prefix(cluster: Cluster) -> None:
    query = cluster.prompt[: 5 * CHUNK] + rand_tokens(20, 2 * CHUNK + 3)
    blocks = rand_blocks(21, -(-len(query) // BS))
    assert cluster.b.lookup(query) == 5 * CHUNK
    out = cluster.tmp / "b-tail.bin"
    assert cluster.b.retrieve(query, blocks, out) == 5 * CHUNK
    assert out.read_bytes() == cluster.expected


def test_divergence_mid_chunk_hits_the_whole_chunks_before_it(cluster: Cluster) -> None:
    query = cluster.prompt[: 3 * CHUNK + 10] + rand_tokens(22, 50)
    assert cluster.b.lookup(query) == 3 * CHUNK
    out = cluster.tmp / "b-mid.bin"
    assert cluster.b.retrieve(query, cluster.blocks_b, out) == 3 * CHUNK
    assert out.read_bytes() == cluster.expected_prefix(3 * CHUNK)


def test_same_tokens_after_a_different_first_chunk_miss(cluster: Cluster) -> None:
    query = rand_tokens(23, CHUNK) + cluster.prompt[CHUNK:]
    assert cluster.b.lookup(query) == 0
    out = cluster.tmp / "b-miss.bin"
    assert cluster.b.retrieve(query, cluster.blocks_b, out) == 0
    assert out.read_bytes() == b""
    untouched = cluster.b.dump(cluster.blocks_b, 5 * CHUNK, cluster.tmp / "b-zero.bin")
    assert not any(untouched)


def test_less_than_a_chunk_misses(cluster: Cluster) -> None:
    assert cluster.b.lookup(cluster.prompt[: CHUNK - 1]) == 0
    assert cluster.b.lookup(cluster.prompt[:CHUNK]) == CHUNK


def test_other_model_misses_and_stores_apart(cluster: Cluster) -> None:
    c = cluster.c
    assert c.lookup(cluster.prompt) == 0
    assert c.retrieve(cluster.prompt, cluster.blocks_b, cluster.tmp / "c-miss.bin") == 0
    # C's (zero) bytes for the same tokens are stored under its own model's keys ...
    assert c.store(cluster.prompt, cluster.blocks_b) == {
        "chunks": 5,
        "stored": 5,
        "present": 0,
        "rejected": 0,
        "skipped": 0,
    }
    assert c.lookup(cluster.prompt) == 5 * CHUNK
    # ... and never reach a worker of the first model
    out = cluster.tmp / "b-after-c.bin"
    assert cluster.b.retrieve(cluster.prompt, rand_blocks(24, 11), out) == 5 * CHUNK
    assert out.read_bytes() == cluster.expected


# ------------------------------------------------------------------------------ eviction

CHUNK_BYTES = CHUNK * TPB  # 8 KiB
CAPACITY = 3 * CHUNK_BYTES + 100  # room for three chunks, not four


@pytest.fixture(scope="module")
def small_l1(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ServerProcess, WorkerProcess, Path]]:
    tmp = tmp_path_factory.mktemp("small-l1")
    server = ServerProcess(tmp, "--chunk-size", str(CHUNK), "--l1-size-gb", repr(CAPACITY / (1 << 30)))
    workers: list[WorkerProcess] = []
    try:
        server.wait_ready()
        workers = start_workers(tmp, server.endpoint, ("W", {"fill": "random", "seed": 5}))
        yield server, workers[0], tmp
        assert workers[0].close() == 0
    finally:
        for w in workers:
            w.stop()
        rc = server.stop()
    assert rc == 0, server.output()


def test_l1_eviction_keeps_the_most_recent_chunks(
    small_l1: tuple[ServerProcess, WorkerProcess, Path],
) -> None:
    _, w, tmp = small_l1
    # 7 one-chunk prompts (plus a partial chunk each), each from its own blocks 0..20
    prompts = [rand_tokens(100 + i, CHUNK + 5) for i in range(7)]
    blocks = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(7)]
    for p, bl in zip(prompts, blocks, strict=True):
        assert w.store(p, bl) == {"chunks": 1, "stored": 1, "present": 0, "rejected": 0, "skipped": 0}
    hits = [w.lookup(p) for p in prompts]
    assert hits == [0, 0, 0, 0, CHUNK, CHUNK, CHUNK]
    for i in (4, 5, 6):
        expected = w.dump(blocks[i], CHUNK, tmp / f"exp-{i}.bin")
        out = tmp / f"got-{i}.bin"
        assert w.retrieve(prompts[i], [40, 41, 42], out) == CHUNK
        assert out.read_bytes() == expected
        assert any(expected)
    for i in (0, 1, 2, 3):
        assert w.retrieve(prompts[i], [40, 41, 42], tmp / f"miss-{i}.bin") == 0
    # reads refreshed 4, 5, 6 in that order: the next store evicts 4
    extra = rand_tokens(200, CHUNK)
    assert w.store(extra, [30, 31]) == {"chunks": 1, "stored": 1, "present": 0, "rejected": 0, "skipped": 0}
    assert [w.lookup(p) for p in (prompts[4], prompts[5], prompts[6], extra)] == [
        0,
        CHUNK,
        CHUNK,
        CHUNK,
    ]
    # an evicted prompt can be stored again
    assert w.store(prompts[0], blocks[0])["stored"] == 1
    assert w.lookup(prompts[0]) == CHUNK
    out = tmp / "got-0-again.bin"
    assert w.retrieve(prompts[0], [50, 51, 52], out) == CHUNK
    assert out.read_bytes() == w.dump(blocks[0], CHUNK, tmp / "exp-0.bin")


def test_l1_prompt_longer_than_capacity(
    small_l1: tuple[ServerProcess, WorkerProcess, Path],
) -> None:
    """A prompt longer than the whole L1 keeps its stored prefix (it never evicts its own
    chunks), says how many chunks it could not store, and later stores keep succeeding."""
    _, w, _ = small_l1
    long_prompt = rand_tokens(300, 5 * CHUNK)
    r = w.store(long_prompt, list(range(22, 32)))
    held = r["stored"] + r["present"]
    assert r["chunks"] == 5 and 0 < held < 5 and r["rejected"] == 5 - held
    assert w.lookup(long_prompt) == held * CHUNK
    small = rand_tokens(301, CHUNK)
    assert w.store(small, [60, 61])["stored"] == 1
    assert w.lookup(small) == CHUNK


# ------------------------------------------------------------------------------ shutdown


@pytest.fixture
def private_shm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory of its own on the shm tmpfs for the server and workers of one test, so no
    other server's start-up sweep can race the segments this test watches."""
    d = Path(tempfile.mkdtemp(prefix="kvw-e2e-", dir="/dev/shm"))
    monkeypatch.setattr(shm, "SHM_DIR", d)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_sigterm_with_workers_attached(tmp_path: Path, private_shm: Path) -> None:
    env = subprocess_env(KVWARDEN_SHM_DIR=str(private_shm))
    server = ServerProcess(tmp_path, "--chunk-size", str(CHUNK), "--l1-size-gb", "0.01", env=env)
    workers: list[WorkerProcess] = []
    try:
        server.wait_ready()
        workers = start_workers(
            tmp_path,
            server.endpoint,
            ("live", {"fill": "random", "seed": 7, "request_timeout": 2.0, "env": env}),
            ("doomed", {"fill": "random", "seed": 8, "env": env}),
        )
        live, doomed = workers
        prompt = rand_tokens(400, 2 * CHUNK)
        assert live.store(prompt, [0, 1, 2, 3])["stored"] == 2
        assert doomed.lookup(prompt) == 2 * CHUNK
        live_segs, doomed_segs = live.info["segments"], doomed.info["segments"]
        assert len(live_segs) == 1 and len(doomed_segs) == 1
        assert all((private_shm / s).exists() for s in live_segs + doomed_segs)

        doomed.kill()  # dies registered: it never unregisters, never unlinks
        assert (private_shm / doomed_segs[0]).exists()
        assert not owner_alive(doomed_segs[0])

        server.sigterm()
        rc = server.proc.wait(30)
        out = server.output()
        assert rc == 0, out
        # nothing is in flight, so the drain ends at once: the loop left it for having nothing
        # in flight (not at its 10 s bound, which would log what was still in flight) and the
        # stop went through
        assert "SIGTERM received" in out and "Traceback" not in out, out
        assert "still in flight at shutdown" not in out and "still alive after" not in out, out
        assert "server: stopped" in out, out

        # on its way out the server released the dead worker's segment; the live one's stays
        assert not (private_shm / doomed_segs[0]).exists()
        assert (private_shm / live_segs[0]).exists() and owner_alive(live_segs[0])

        assert live.close() == 0, live.stderr()  # its UNREGISTER fails; it still cleans up
        leftovers = [p.name for p in private_shm.iterdir()]
        assert leftovers == [], leftovers
    finally:
        for w in workers:
            w.stop()
        server.stop()
    # the same holds for every segment these processes made in /dev/shm proper
    pids = {server.proc.pid, *(w.pid for w in workers)}
    assert kvwarden_segments_of(Path("/dev/shm"), pids) == []
