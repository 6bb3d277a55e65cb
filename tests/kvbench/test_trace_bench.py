"""`kvwarden bench trace`: traces read and generated, the simulator's policies, and the replay
through a real server held to the simulator."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench import trace
from kvbench.trace_data import (
    BLOCK_TOKENS,
    TraceRequest,
    TraceShape,
    dump,
    generate,
    load,
    prompt_tokens,
    unique_full_blocks,
)
from kvbench.trace_sim import simulate
from tests.helpers import ROOT, subprocess_env


def req(ids: list[int], tail: int = BLOCK_TOKENS, ts: int = 0) -> TraceRequest:
    return TraceRequest(ts, (len(ids) - 1) * BLOCK_TOKENS + tail, 1, tuple(ids))


def test_a_trace_file_round_trips_and_bad_lines_are_named(tmp_path: Path) -> None:
    reqs = generate(TraceShape(requests=50, conversations=5, seed=3))
    assert reqs == generate(TraceShape(requests=50, conversations=5, seed=3))  # deterministic
    p = tmp_path / "t.jsonl"
    dump(reqs, p)
    assert load(p) == reqs and load(p, limit=7) == reqs[:7]
    bad = {
        '{"timestamp": 0, "input_length": 10, "hash_ids": []}': "hash_ids must be a non-empty list",
        '{"timestamp": -1, "input_length": 10, "hash_ids": [1]}': "timestamp must be an integer >= 0",
        '{"input_length": 2000, "hash_ids": [1]}': "input_length 2000 does not fit 1 blocks",
        "[1, 2]": "a request is a JSON object",
        "{nope": "not JSON",
    }
    for line, msg in bad.items():
        p.write_text(line + "\n")
        with pytest.raises(ValueError, match=msg) as exc:
            load(p)
        assert f"{p}:1" in str(exc.value)


def test_shared_prefixes_share_tokens_and_a_partial_last_block_is_not_a_full_one() -> None:
    a, b = req([1, 2, 3], tail=100), req([1, 2, 4])
    ta, tb = prompt_tokens(a), prompt_tokens(b)
    assert len(ta) == 2 * BLOCK_TOKENS + 100 and (ta[: 2 * BLOCK_TOKENS] == tb[: 2 * BLOCK_TOKENS]).all()
    assert (ta[2 * BLOCK_TOKENS :] != tb[2 * BLOCK_TOKENS : 2 * BLOCK_TOKENS + 100]).any()
    assert a.full_blocks == 2 and b.full_blocks == 3 and unique_full_blocks([a, b]) == 3


def test_lru_and_the_optimum_on_a_small_trace_by_hand() -> None:
    reqs = [req([1, 2]), req([3, 4]), req([1, 2]), req([5, 6]), req([3, 4]), req([1, 2])]
    lru = simulate(reqs, 4, "lru")
    # LRU: [1,2] [3,4] hit 1,2; then 5,6 evict 3,4; [3,4] miss, evicts 1,2; [1,2] miss
    assert (lru.hit_blocks, lru.blocks) == (2, 12)
    opt = simulate(reqs, 4, "optimum")
    # the optimum never admits 5,6 (used never again): every later request hits
    assert opt.hit_blocks == 6 and opt.block_rate == 0.5
    assert simulate(reqs, 100, "lru").hit_blocks == simulate(reqs, 100, "optimum").hit_blocks == 6
    with pytest.raises(ValueError, match="lru, lfuda or optimum"):
        simulate(reqs, 4, "fifo")


def test_lfuda_keeps_the_prefix_read_most_where_lru_keeps_the_latest() -> None:
    hot, *once = [req([1, 2])], req([3, 4]), req([5, 6]), req([7, 8])
    reqs = [*hot, *hot, *hot, *once, *hot]  # [1,2] read twice, then three one-offs, then again
    assert simulate(reqs, 4, "lru").hit_blocks == 4  # the one-offs pushed [1,2] out
    assert simulate(reqs, 4, "lfuda").hit_blocks == 6  # read twice: it outlived them


def test_the_optimum_bounds_lru_at_every_capacity_of_a_generated_trace() -> None:
    reqs = generate(TraceShape(requests=400, conversations=30, seed=1))
    u = unique_full_blocks(reqs)
    last = -1.0
    for share in (0.02, 0.05, 0.1, 0.25, 0.5, 1.0):
        lru, opt = simulate(reqs, int(share * u), "lru"), simulate(reqs, int(share * u), "optimum")
        assert opt.hit_blocks >= lru.hit_blocks and opt.block_rate >= last
        last = opt.block_rate
    assert lru.hit_blocks == opt.hit_blocks  # all of it fits: both get every reachable hit


@pytest.mark.parametrize("policy", ["lru", "lfuda"])
def test_the_replay_through_a_real_server_matches_the_simulator(tmp_path: Path, policy: str) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "bench",
            "trace",
            "--tiny",
            "--policy",
            policy,
            "--json",
            "--results-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    (path,) = tmp_path.glob("trace-*.json")
    rep = json.loads(path.read_text())
    assert len(rep["rows"]) == 2 and rep["requests"] == 120 and rep["policy"] == policy
    for r in rep["rows"]:
        assert abs(r["server_vs_sim_points"]) <= 1.0, r
        assert r["server"]["block_rate"] > 0 and r["optimum"]["block_rate"] >= r["simulated"]["block_rate"]
        assert r["optimum"]["block_rate"] >= r["lru"]["block_rate"]
        assert r["server"]["requests_per_s"] > 0 and r["server"]["bytes_moved"] > 0
    assert "server - sim" in out.stdout and f"{policy} (sim)" in out.stdout


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        (["--capacities", "0,2"], "--capacities takes shares"),
        (["--trace", "/nonexistent/none.jsonl"], "No such file"),
        (["--speed", "0"], "--speed must be > 0"),
    ],
)
def test_bad_flags_exit_2_naming_them(args: list[str], msg: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="kvwarden bench")
    trace.add_args(parser.add_subparsers())
    ns = parser.parse_args(["trace", "--tiny", *args])
    assert ns.func(ns) == 2
    assert msg in capsys.readouterr().err
