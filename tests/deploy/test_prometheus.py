"""The operations kit against real programs: promtool checks the scrape config and the rules and
runs the alert unit tests; a real Prometheus scrapes a live ``kvwarden serve`` (a real Redis as
its remote tier, a directory as its file tier, a worker storing and retrieving, an instance
reaped by an operator, a damaged chunk file found on disk) and answers ``kvwarden_healthy``, the
recording rule ``lmcache:is_healthy`` and every PromQL expression of every dashboard panel with
a non-empty result; every metric name the dashboard and the rules use (found by a real PromQL
parser) exists in the server's /metrics."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import promql_parser
import pytest
import torch
import yaml

from dataplane.client import WorkerAdapter, allocate_kv_caches
from kvbench.procs import free_port
from tests.helpers import ROOT, ServerProcess, subprocess_env, wait_until
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(300)
PROM = ROOT / "deploy" / "prometheus"
TOKEN = "prometheus-test-admin-token"
CHUNK = 16


def _gen() -> Any:
    spec = importlib.util.spec_from_file_location("gen_deploy", ROOT / "scripts" / "gen_deploy.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gen = _gen()


def promtool(*args: str) -> str:
    p = subprocess.run(["promtool", *args], cwd=PROM, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout + p.stderr


def test_generated_files_are_current() -> None:
    p = subprocess.run(
        [sys.executable, "scripts/gen_deploy.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr


def test_promtool_checks_the_config_and_the_rules() -> None:
    assert "SUCCESS" in promtool("check", "config", "prometheus.yml")
    out = promtool("check", "rules", "alerts.yml", "recording.yml")
    assert "14 rules found" in out and "7 rules found" in out


def test_every_alert_has_a_unit_test_that_fires_and_one_that_stays_quiet() -> None:
    assert "SUCCESS" in promtool("test", "rules", "tests/alerts_test.yml")
    tests = yaml.safe_load((PROM / "tests" / "alerts_test.yml").read_text())["tests"]
    for t in tests:
        fired = [c for c in t["alert_rule_test"] if c["exp_alerts"]]
        quiet = [c for c in t["alert_rule_test"] if not c["exp_alerts"]]
        assert fired and quiet, t["name"]
    assert {t["name"] for t in tests} == set(gen.alert_rules())


def test_a_broken_rule_fails_its_unit_test(tmp_path: Path) -> None:
    """The unit tests can fail: the same tests against a rule that never fires."""
    shutil.copytree(PROM, tmp_path / "prometheus")
    alerts = tmp_path / "prometheus" / "alerts.yml"
    alerts.write_text(
        alerts.read_text().replace("expr: kvwarden_healthy == 0", "expr: kvwarden_healthy == 2")
    )
    p = subprocess.run(
        ["promtool", "test", "rules", "tests/alerts_test.yml"],
        cwd=tmp_path / "prometheus",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode != 0 and "KVWardenUnhealthy" in p.stdout + p.stderr


def test_every_alert_has_a_summary_description_and_a_runbook_section() -> None:
    runbooks = (ROOT / "docs" / "runbooks.md").read_text()
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", runbooks, re.M)
    }
    for name, rule in gen.alert_rules().items():
        notes = rule["annotations"]
        assert notes["summary"] and notes["description"], name
        page, anchor = notes["runbook_url"].split("#")
        assert page == "docs/runbooks.md" and anchor in anchors, (name, anchor)


def metric_names(expr: str) -> set[str]:
    """Names of every series selector of ``expr`` (parsed by promql-parser)."""
    names: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            names.add(str(node.name))
        elif isinstance(node, promql_parser.MatrixSelector):
            walk(node.vector_selector)
        elif isinstance(node, promql_parser.BinaryExpr):
            walk(node.lhs)
            walk(node.rhs)
        elif isinstance(node, promql_parser.Call):
            for a in node.args:
                walk(a)
        elif isinstance(
            node,
            promql_parser.AggregateExpr
            | promql_parser.ParenExpr
            | promql_parser.UnaryExpr
            | promql_parser.SubqueryExpr,
        ):
            walk(node.expr)

    walk(promql_parser.parse(expr))
    return names


def concrete(expr: str) -> str:
    return expr.replace("$__rate_interval", "1m")


@pytest.fixture
def live(tmp_path: Path, redis_server: RedisServer) -> Iterator[tuple[ServerProcess, str]]:
    """A live server (remote and file tiers on), a worker that stored, retrieved and was reaped,
    a damaged file it found on disk, and a Prometheus scraping it every second with the kit's
    rules, ready; (server, Prometheus URL)."""
    env = subprocess_env(KVWARDEN_ADMIN_TOKEN=TOKEN)
    fs = tmp_path / "fs"
    fs.mkdir()
    srv = ServerProcess(
        tmp_path / "kv",
        "--chunk-size",
        str(CHUNK),
        "--remote-url",
        redis_server.url,
        "--fs-path",
        str(fs),
        "--fs-size-gb",
        "1",
        env=env,
    )
    srv.wait_ready()
    port = free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(PROM / "alerts.yml"), str(PROM / "recording.yml")],
                "scrape_configs": [
                    {"job_name": "kvwarden", "static_configs": [{"targets": [f"127.0.0.1:{srv.http_port}"]}]}
                ],
            }
        )
    )
    log_path = tmp_path / "prometheus.log"
    log = open(log_path, "wb")  # noqa: SIM115
    prom = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={cfg}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _traffic(srv)
        _bad_file(srv, fs, tmp_path / "seed")
        wait_prometheus_ready(url, prom, log_path)
        yield srv, url
    finally:
        prom.terminate()
        prom.wait(30)
        log.close()
        srv.stop()


def _traffic(srv: ServerProcess) -> None:
    caches = allocate_kv_caches(2, 8, 16, 2, 8, dtype=torch.bfloat16)
    tokens = np.arange(4 * CHUNK)
    with WorkerAdapter(srv.endpoint, "prom-test", heartbeat_interval=1.0) as w:
        w.register_kv_caches(caches)
        assert w.store(tokens, np.arange(8))
        assert w.retrieve(tokens, np.arange(8)[::-1].copy()) == 4 * CHUNK
        assert w.lookup(tokens) == 4 * CHUNK
        other = WorkerAdapter(srv.endpoint, "prom-test-reaped", heartbeat_interval=1.0)
        other.register_kv_caches(allocate_kv_caches(2, 8, 16, 2, 8, dtype=torch.bfloat16))
        r = httpx.post(
            f"http://127.0.0.1:{srv.http_port}/instances/{other.instance_id}/reap",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=10,
        )
        assert r.status_code == 200, r.text
        other.close()


def _fs(srv: ServerProcess) -> dict[str, Any]:
    doc: dict[str, Any] = httpx.get(f"http://127.0.0.1:{srv.http_port}/status", timeout=10).json()
    return dict(doc["storage"]["fs"])


def _chunk_files(root: Path) -> set[Path]:
    return set(root.glob("kvwarden-v2/*/*/*/*.kv"))


def _bad_file(srv: ServerProcess, root: Path, workdir: Path) -> None:
    """A damaged chunk file in ``srv``'s file tier, found by it (so `kvwarden_fs_bad_files_total`
    has a series): another server on the same directory writes a chunk, its file is damaged, and
    ``srv``'s LOOKUP finds it on disk; reading it, ``srv`` refuses and removes it."""
    wait_until(
        lambda: _fs(srv)["puts"] >= 4 and _fs(srv)["queue_depth"] == 0, 20, 0.05, what="the chunks on disk"
    )
    ours = _chunk_files(root)
    tokens = np.arange(CHUNK) + 10_000
    seed = ServerProcess(workdir, "--chunk-size", str(CHUNK), "--fs-path", str(root), "--fs-size-gb", "1")
    try:
        seed.wait_ready()
        with WorkerAdapter(seed.endpoint, "prom-test", heartbeat_interval=1.0) as w:
            w.register_kv_caches(allocate_kv_caches(2, 8, 16, 2, 8, dtype=torch.bfloat16))
            assert w.store(tokens, np.arange(8))
        (path,) = wait_until(lambda: _chunk_files(root) - ours, 20, 0.05, what="the other server's file")
    finally:
        seed.stop()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with WorkerAdapter(srv.endpoint, "prom-test", heartbeat_interval=1.0) as w:
        w.register_kv_caches(allocate_kv_caches(2, 8, 16, 2, 8, dtype=torch.bfloat16))
        assert w.lookup(tokens) == CHUNK  # on disk (a stat): read ahead into L1, and refused
        assert w.retrieve(tokens, np.arange(8)) == 0
    # (counted once per read that found it bad: the RETRIEVE may read it again before the removal,
    # which runs on the tier's I/O threads, has happened)
    wait_until(lambda: _fs(srv)["bad_files"] >= 1 and not path.exists(), 10, 0.05, what="the bad file")


def wait_prometheus_ready(
    url: str, proc: subprocess.Popen[bytes], log_path: Path, timeout: float = 60.0
) -> None:
    """Until Prometheus says it is ready: ``/-/ready`` answers 200 (while it starts, it refuses
    connections, then answers 503 in plain text, to that route and to queries alike)."""

    def ready() -> bool:
        if proc.poll() is not None:
            log = log_path.read_text(errors="replace")[-3000:]
            raise AssertionError(f"prometheus exited with {proc.returncode} while starting:\n{log}")
        try:
            return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(ready, timeout, 0.1, what="Prometheus ready (/-/ready)")


def query(prom: str, expr: str) -> list[dict[str, Any]]:
    """The result of an instant query of a ready Prometheus; an answer that is not a JSON success
    fails the test, naming what came back."""
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=5)
    try:
        body = r.json()
    except ValueError:
        raise AssertionError(
            f"{expr}: Prometheus answered {r.status_code}, not JSON: {r.text[:200]!r}"
        ) from None
    assert r.status_code == 200 and body.get("status") == "success", (expr, r.status_code, body)
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def test_prometheus_answers_every_dashboard_query_of_a_live_server(live: tuple[ServerProcess, str]) -> None:
    srv, prom = live
    (up,) = wait_until(lambda: query(prom, "kvwarden_healthy"), 60, 0.5, what="kvwarden_healthy scraped")
    assert up["value"][1] == "1"
    (compat,) = wait_until(lambda: query(prom, "lmcache:is_healthy"), 60, 0.5, what="the recording rule")
    assert compat["value"][1] == "1"
    for expr in gen.panel_queries():
        assert wait_until(lambda e=expr: query(prom, concrete(e)), 60, 0.5, what=f"a result for {expr}")
    # and every metric name the dashboard and the rules use is one the server exports
    exported = set(
        re.findall(
            r"^([a-zA-Z_:][a-zA-Z0-9_:]*)", httpx.get(f"http://127.0.0.1:{srv.http_port}/metrics").text, re.M
        )
    )
    recorded = {r["record"] for g in gen.load("recording.yml")["groups"] for r in g["rules"]}
    rules = [
        r["expr"] for f in ("alerts.yml", "recording.yml") for g in gen.load(f)["groups"] for r in g["rules"]
    ]
    for expr in [*map(concrete, gen.panel_queries()), *rules]:
        for name in metric_names(expr):
            assert name in exported or name in recorded or name == "up", (name, expr)
