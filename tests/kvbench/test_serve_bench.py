"""`kvwarden bench serve --tiny --json` end to end, with real vLLM OpenAI servers (``.venv-vllm``)
and a real ``redis-server``: both protocols run against the ideal row and the Redis row, every
request is answered, the report holds every figure, and the Redis row's hits really come from
kvwarden (its engine cache holds about one document: the query round's prefixes are read from
Redis, ahead of the RETRIEVE). The numbers mean nothing at this size. Marked ``bench``: a whole
benchmark run, out of ``make test``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.vllm_support import VLLM_PYTHON, require_vllm
from tests.helpers import ROOT, subprocess_env

pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("vllm")]  # one worker: the vLLM engines


# A whole benchmark run (two minutes on a 2-core host): with KVWARDEN_BENCH=1 or -m bench. make
# test covers OpenAI servers with the connector (tests/e2e/test_vllm_handoff.py) and an engine's
# hits from Redis (tests/e2e/test_vllm_reset.py).
@pytest.mark.bench
def test_bench_serve_tiny(tmp_path: Path) -> None:
    require_vllm()
    cmd = [sys.executable, "-m", "app.cli", "bench", "serve", "--tiny", "--json", "--configs", "ideal,redis"]
    cmd += [
        "--results-dir",
        str(tmp_path),
        "--vllm-python",
        str(VLLM_PYTHON),
        "--plot",
        str(tmp_path / "p.png"),
    ]
    p = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=850)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    (path,) = [line.split(": ", 1)[1] for line in p.stdout.splitlines() if line.startswith("results: ")]
    rep = json.loads(Path(path).read_text())
    assert rep["benchmark"] == "serve" and rep["tier"] == "tiny"
    docs, chat = rep["docqa"], rep["chat"]
    assert set(docs) == set(chat) == {"ideal", "redis"}
    for rows in (docs, chat):
        for row in rows.values():
            assert row["errors"] == []
    n = rep["params"]["docqa"]["docs"] * rep["params"]["docqa"]["repeat"]
    for row in docs.values():
        assert row["query_ttft"]["n"] == n and row["query_ttft"]["mean"] > 0
        assert row["probe"].get("max_gap_s", 0) > 0
    # 600-token documents and a 32-token question: two full chunks of 256 come from Redis
    assert docs["redis"]["cached_tokens"] >= 512
    m = docs["redis"]["kvwarden_metrics"]
    promoted = sum(v for k, v in m.items() if k.startswith("kvwarden_remote_read_ahead_total"))
    assert promoted > 0, m
    assert m.get("kvwarden_prefetches_total", 0) > 0, m  # the connector's on_new_request
    assert any(t["what"].startswith("query-round mean TTFT, redis") for t in rep["targets"])
    assert (tmp_path / "p.png").stat().st_size > 0
    assert "Long-document QA" in p.stdout and "Multi-round chat" in p.stdout
