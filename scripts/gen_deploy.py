"""Generate what the deploy kit derives from its one source of rules.

    python scripts/gen_deploy.py           write the generated files
    python scripts/gen_deploy.py --check   exit 1 naming any generated file that is out of date

From ``deploy/prometheus/alerts.yml`` and ``recording.yml`` (the source):
- ``deploy/k8s/prometheusrule.yaml``: the same groups as a Prometheus Operator PrometheusRule;
- ``deploy/grafana/dashboards/kvwarden.json``: the Grafana dashboard, from ``GROUPS`` below (the
  server's panels, then a row of panels per optional tier);
- ``deploy/prometheus/tests/alerts_test.yml``: promtool unit tests, one scenario per alert (below)
  in which it fires for one series and stays quiet for another, and a time where it is quiet;
  each expected alert's annotations are the rule's templates with its labels filled in.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
PROM = ROOT / "deploy" / "prometheus"
RULE_TEST = PROM / "tests" / "alerts_test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "kvwarden.json"
RI = "$__rate_interval"
LATENCY = f"sum by (type, le) (rate(kvwarden_request_duration_seconds_bucket[{RI}]))"
# (title, unit, kind, [(PromQL, legend)]), in rows of three
PANELS: list[tuple[str, str, str, list[tuple[str, str]]]] = [
    ("Healthy", "none", "stat", [("kvwarden_healthy", "{{instance}}")]),
    ("Backends bypassed", "none", "stat", [("kvwarden_backend_bypassed", "{{instance}} {{backend}}")]),
    (
        "Tracked instances by transfer mode",
        "none",
        "timeseries",
        [("sum by (transfer_mode) (kvwarden_tracked_instances)", "{{transfer_mode}}")],
    ),
    (
        "Reaps by reason",
        "none",
        "timeseries",
        [(f"sum by (reason) (increase(kvwarden_instances_reaped_total[{RI}]))", "{{reason}}")],
    ),
    (
        "Requests per second by type",
        "reqps",
        "timeseries",
        [(f"sum by (type) (rate(kvwarden_requests_total[{RI}]))", "{{type}}")],
    ),
    (
        "Request latency p50 / p99 by type",
        "s",
        "timeseries",
        [
            (
                f"histogram_quantile(0.5, {LATENCY})",
                "p50 {{type}}",
            ),
            (
                f"histogram_quantile(0.99, {LATENCY})",
                "p99 {{type}}",
            ),
        ],
    ),
    (
        "Transfer bytes per second",
        "Bps",
        "timeseries",
        [(f"sum by (direction) (rate(kvwarden_transfer_bytes_total[{RI}]))", "{{direction}}")],
    ),
    (
        "Hit ratio (tokens, 5 min)",
        "percentunit",
        "timeseries",
        [("kvwarden:hit_ratio:rate5m", "{{instance}}")],
    ),
    (
        "L1 used",
        "percentunit",
        "timeseries",
        [
            ("kvwarden_l1_used_bytes / kvwarden_l1_capacity_bytes", "{{instance}}"),
        ],
    ),
    (
        "L1 evictions per second",
        "ops",
        "timeseries",
        [(f"sum by (reason) (rate(kvwarden_l1_evictions_by_reason_total[{RI}]))", "{{reason}}")],
    ),
    (
        "Chunk hits per second, by tier",
        "ops",
        "timeseries",
        [
            (f"sum(rate(kvwarden_l1_hits_total[{RI}]))", "L1"),
            (f"sum(rate(kvwarden_fs_hits_total[{RI}]))", "file tier"),
            (f"sum(rate(kvwarden_remote_hits_total[{RI}]))", "remote"),
        ],
    ),
    (
        "Requests waiting for a store in flight",
        "ops",
        "timeseries",
        [
            (f"sum by (outcome) (rate(kvwarden_lookup_waits_total[{RI}]))", "{{outcome}}"),
            (
                f"histogram_quantile(0.99, sum by (le) (rate(kvwarden_lookup_wait_seconds_bucket[{RI}])))",
                "p99 wait (s)",
            ),
        ],
    ),
    (
        "Remote ping latency",
        "s",
        "timeseries",
        [("kvwarden_remote_ping_latency_seconds", "{{instance}} {{backend}}")],
    ),
    (
        "Remote errors per second",
        "ops",
        "timeseries",
        [
            (f"sum by (backend) (rate(kvwarden_remote_get_failures_total[{RI}]))", "get {{backend}}"),
            (f"sum by (backend) (rate(kvwarden_remote_put_failures_total[{RI}]))", "put {{backend}}"),
            (f"sum by (backend) (rate(kvwarden_remote_ping_errors_total[{RI}]))", "ping {{backend}}"),
        ],
    ),
    (
        "Remote tier out of space (Redis answering OOM)",
        "none",
        "stat",
        [("kvwarden_remote_out_of_space", "{{instance}} {{backend}}")],
    ),
    (
        "Write-behind queue and drops",
        "bytes",
        "timeseries",
        [
            ("kvwarden_remote_write_queue_bytes", "queued {{backend}}"),
            (
                f"sum by (backend) (increase(kvwarden_remote_dropped_writes_total[{RI}]))",
                "dropped {{backend}}",
            ),
        ],
    ),
]
FS_LATENCY = f"sum by (op, le) (rate(kvwarden_fs_duration_seconds_bucket[{RI}]))"
# the file tier (series only with fs_path)
FS_PANELS: list[tuple[str, str, str, list[tuple[str, str]]]] = [
    (
        "File tier bypassed / out of space / index rebuilt",
        "none",
        "stat",
        [
            ("kvwarden_fs_bypassed", "bypassed {{instance}}"),
            ("kvwarden_fs_out_of_space", "out of space {{instance}}"),
            ("kvwarden_fs_rebuilt", "rebuilt {{instance}}"),
        ],
    ),
    (
        "File tier used vs capacity",
        "bytes",
        "timeseries",
        [
            ("kvwarden_fs_used_bytes", "used {{instance}}"),
            ("kvwarden_fs_capacity_bytes", "capacity {{instance}}"),
        ],
    ),
    (
        "File tier hits, misses and read-ahead per second",
        "ops",
        "timeseries",
        [
            (f"rate(kvwarden_fs_hits_total[{RI}])", "hits {{instance}}"),
            (f"rate(kvwarden_fs_misses_total[{RI}])", "misses {{instance}}"),
            (f"rate(kvwarden_fs_read_ahead_total[{RI}])", "read-ahead {{instance}}"),
            (f"rate(kvwarden_fs_read_in_place_total[{RI}])", "read in place {{instance}}"),
        ],
    ),
    (
        "File tier bytes read / written per second",
        "Bps",
        "timeseries",
        [
            (f"rate(kvwarden_fs_read_bytes_total[{RI}])", "read {{instance}}"),
            (f"rate(kvwarden_fs_written_bytes_total[{RI}])", "written {{instance}}"),
        ],
    ),
    (
        "File tier disk call latency p50 / p99 by op",
        "s",
        "timeseries",
        [
            (f"histogram_quantile(0.5, {FS_LATENCY})", "p50 {{op}}"),
            (f"histogram_quantile(0.99, {FS_LATENCY})", "p99 {{op}}"),
        ],
    ),
    (
        "File tier stalled disk call and probe latency",
        "s",
        "timeseries",
        [
            ("kvwarden_fs_stalled_seconds", "stalled {{instance}}"),
            ("kvwarden_fs_probe_latency_seconds", "probe {{instance}}"),
        ],
    ),
    (
        "File tier failures per second by op and kind",
        "ops",
        "timeseries",
        [(f"sum by (op, kind) (rate(kvwarden_fs_failures_total[{RI}]))", "{{op}} {{kind}}")],
    ),
    (
        "File tier bad, evicted and swept files",
        "none",
        "timeseries",
        [
            (f"sum by (kind) (increase(kvwarden_fs_bad_files_total[{RI}]))", "bad {{kind}}"),
            (f"increase(kvwarden_fs_evictions_total[{RI}])", "evicted {{instance}}"),
            (f"increase(kvwarden_fs_swept_files_total[{RI}])", "swept {{instance}}"),
        ],
    ),
    (
        "File tier write queue",
        "bytes",
        "timeseries",
        [("kvwarden_fs_write_queue_bytes", "queued {{instance}}")],
    ),
    (
        "File tier writes waiting and dropped",
        "none",
        "timeseries",
        [
            ("kvwarden_fs_write_queue_depth", "waiting {{instance}}"),
            (f"sum by (reason) (increase(kvwarden_fs_dropped_writes_total[{RI}]))", "dropped {{reason}}"),
        ],
    ),
]
# (row title, its panels): the first group has no row of its own
GROUPS: list[tuple[str, list[tuple[str, str, str, list[tuple[str, str]]]]]] = [
    ("", PANELS),
    ("File tier", FS_PANELS),
]
K8S_RULE = ROOT / "deploy" / "k8s" / "prometheusrule.yaml"
HEADER = "# Generated by scripts/gen_deploy.py from deploy/prometheus/{alerts,recording}.yml: do not edit.\n"

A = 'instance="kv-a:8080", job="kvwarden"'  # the series an alert fires for
B = 'instance="kv-b:8080", job="kvwarden"'  # the series it stays quiet for
LA = {"instance": "kv-a:8080", "job": "kvwarden"}
LB = {"instance": "kv-b:8080", "job": "kvwarden"}
R = 'backend="redis"'

# alert -> (input series, [(eval time, labels of each expected alert)])
SCENARIOS: dict[str, tuple[list[tuple[str, str]], list[tuple[str, list[dict[str, str]]]]]] = {
    "KVWardenUnhealthy": (
        [(f"kvwarden_healthy{{{A}}}", "1 1 0x6"), (f"kvwarden_healthy{{{B}}}", "1x8")],
        [("3m", []), ("5m", [LA])],
    ),
    "KVWardenBackendBypassed": (
        [
            (f"kvwarden_backend_bypassed{{{A}, {R}}}", "0 0 1x4"),
            (f"kvwarden_backend_bypassed{{{B}, {R}}}", "0x6"),
            (f"kvwarden_fs_bypassed{{{A}}}", "0x6"),
            (f"kvwarden_fs_bypassed{{{B}}}", "0 0 1x4"),
        ],
        [("2m", []), ("4m", [{**LA, "backend": "redis"}, {**LB, "backend": "fs"}])],
    ),
    "KVWardenReapBurst": (
        [
            (f'kvwarden_instances_reaped_total{{{A}, reason="timeout"}}', "0 0 10x12"),
            (f'kvwarden_instances_reaped_total{{{B}, reason="admin"}}', "0 0 50x12"),
            (f'kvwarden_instances_reaped_total{{{B}, reason="timeout"}}', "0 0 1x12"),
        ],
        [("3m", [{"instance": "kv-a:8080"}]), ("14m", [])],
    ),
    "KVWardenWorkerReapedRepeatedly": (
        [
            (f'kvwarden_instances_reaped_total{{{A}, reason="timeout"}}', "0+0.2x60"),
            (f'kvwarden_instances_reaped_total{{{B}, reason="timeout"}}', "0 1x59"),
        ],
        [("15m", []), ("40m", [{"instance": "kv-a:8080"}])],
    ),
    "KVWardenRemotePingLatencyHigh": (
        [
            (f"kvwarden_remote_ping_latency_seconds{{{A}, {R}}}", "0.5x10"),
            (f"kvwarden_remote_ping_latency_seconds{{{B}, {R}}}", "0.01x10"),
        ],
        [("3m", []), ("7m", [{**LA, "backend": "redis"}])],
    ),
    "KVWardenRemoteErrors": (
        [
            (f'kvwarden_remote_failures_total{{{A}, {R}, op="get", kind="timeout"}}', "0+60x15"),
            (f'kvwarden_remote_failures_total{{{B}, {R}, op="get", kind="timeout"}}', "0x15"),
        ],
        [
            ("4m", []),
            ("12m", [{"instance": "kv-a:8080", "backend": "redis", "op": "get", "kind": "timeout"}]),
        ],
    ),
    "KVWardenL1NearCapacity": (
        [
            (f"kvwarden_l1_used_bytes{{{A}}}", "99x60"),
            (f"kvwarden_l1_capacity_bytes{{{A}}}", "100x60"),
            (f"kvwarden_l1_evictions_total{{{A}}}", "0+120x60"),
            (f"kvwarden_l1_used_bytes{{{B}}}", "99x60"),
            (f"kvwarden_l1_capacity_bytes{{{B}}}", "100x60"),
            (f"kvwarden_l1_evictions_total{{{B}}}", "0x60"),
        ],
        [("20m", []), ("50m", [LA])],
    ),
    "KVWardenWriteBehindDrops": (
        [
            (f"kvwarden_remote_dropped_writes_total{{{A}, {R}}}", "0 0 5x4"),
            (f"kvwarden_remote_dropped_writes_total{{{B}, {R}}}", "3x6"),
        ],
        [("1m", []), ("3m", [{**LA, "backend": "redis"}])],
    ),
    "KVWardenFsErrors": (
        [
            (f'kvwarden_fs_failures_total{{{A}, op="put", kind="no_space"}}', "0+60x15"),
            (f'kvwarden_fs_failures_total{{{A}, op="get", kind="io"}}', "0+3x15"),
            (f'kvwarden_fs_failures_total{{{B}, op="put", kind="no_space"}}', "0x15"),
        ],
        [
            ("4m", []),
            ("12m", [{"instance": "kv-a:8080", "op": "put", "kind": "no_space"}]),
        ],
    ),
    "KVWardenFsStalled": (
        [
            (f"kvwarden_fs_stalled_seconds{{{A}}}", "0 0 30+60x8"),
            (f"kvwarden_fs_stalled_seconds{{{B}}}", "0 0 8 0 9 0 7 0 9 0"),
        ],
        [("3m", []), ("5m", [LA])],
    ),
    "KVWardenFsBadFiles": (
        [
            # a kind's series appears with the first bad file of its kind (at 18m); another grows
            (f'kvwarden_fs_bad_files_total{{{A}, kind="checksum"}}', "_x18 1x27"),
            (f'kvwarden_fs_bad_files_total{{{A}, kind="truncated"}}', "1x20 3x25"),
            (f'kvwarden_fs_bad_files_total{{{B}, kind="checksum"}}', "4x45"),
        ],
        [
            ("17m", []),
            ("20m", [{"instance": "kv-a:8080", "kind": "checksum"}]),
            ("25m", [{"instance": "kv-a:8080", "kind": kind} for kind in ("checksum", "truncated")]),
            ("40m", []),
        ],
    ),
    "KVWardenFsWriteDrops": (
        [
            (f'kvwarden_fs_dropped_writes_total{{{A}, reason="full"}}', "0 0 5x4"),
            (f'kvwarden_fs_dropped_writes_total{{{A}, reason="stopped"}}', "0 0 7x4"),
            (f'kvwarden_fs_dropped_writes_total{{{B}, reason="full"}}', "3x6"),
        ],
        [("1m", []), ("3m", [{"instance": "kv-a:8080", "reason": "full"}])],
    ),
    "KVWardenOutOfSpace": (
        [
            (f"kvwarden_fs_out_of_space{{{A}}}", "0 0 1x8"),
            (f"kvwarden_remote_out_of_space{{{A}, {R}}}", "0 0 0 0 1x6"),
            (f"kvwarden_fs_out_of_space{{{B}}}", "0 1 0 1 0 1 0 1 0 1"),  # brief episodes: quiet
            (f"kvwarden_remote_out_of_space{{{B}, {R}}}", "0x10"),
        ],
        [
            ("3m", []),
            ("5m", [{**LA, "backend": "fs"}]),
            ("7m", [{**LA, "backend": "fs"}, {**LA, "backend": "redis"}]),
        ],
    ),
    "KVWardenScrapeDown": (
        [(f"up{{{A}}}", "1 0x5"), (f"up{{{B}}}", "1x6")],
        [("2m", []), ("4m", [LA])],
    ),
}


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((PROM / name).read_text())
    return data


def alert_rules() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in load("alerts.yml")["groups"] for r in g["rules"]}


def render(template: str, labels: dict[str, str]) -> str:
    """A rule's annotation with ``{{ $labels.x }}`` filled in (the only template they use)."""
    out = re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)
    if "{{" in out:
        raise ValueError(f"annotation template beyond $labels: {template!r}")
    return out


def rule_tests() -> dict[str, Any]:
    rules = alert_rules()
    missing = set(rules) ^ set(SCENARIOS)
    if missing:
        raise SystemExit(f"gen_deploy: alerts and scenarios differ: {sorted(missing)}")
    tests = []
    for name, (series, evals) in SCENARIOS.items():
        rule = rules[name]
        cases = []
        for at, expected in evals:
            exp = []
            for labels in expected:
                full = {**labels, **rule.get("labels", {})}
                notes = {k: render(v, full) for k, v in rule.get("annotations", {}).items()}
                exp.append({"exp_labels": full, "exp_annotations": notes})
            cases.append({"eval_time": at, "alertname": name, "exp_alerts": exp})
        tests.append(
            {
                "name": name,
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series],
                "alert_rule_test": cases,
            }
        )
    return {"rule_files": ["../alerts.yml"], "evaluation_interval": "1m", "tests": tests}


def prometheus_rule() -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "kvwarden",
            "labels": {"app.kubernetes.io/name": "kvwarden", "app.kubernetes.io/part-of": "kvwarden"},
        },
        "spec": {"groups": load("alerts.yml")["groups"] + load("recording.yml")["groups"]},
    }


def dashboard() -> dict[str, Any]:
    ds = {"type": "prometheus", "uid": "${datasource}"}
    panels: list[dict[str, Any]] = []
    y = 0  # the top of the next group
    for row, group in GROUPS:
        if row:
            panels.append(
                {
                    "id": len(panels) + 1,
                    "type": "row",
                    "title": row,
                    "collapsed": False,
                    "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                    "panels": [],
                }
            )
            y += 1
        for i, (title, unit, kind, queries) in enumerate(group):
            panels.append(
                {
                    "id": len(panels) + 1,
                    "type": kind,
                    "title": title,
                    "datasource": ds,
                    "gridPos": {"h": 8, "w": 8, "x": 8 * (i % 3), "y": y + 8 * (i // 3)},
                    "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                    "targets": [
                        {"refId": chr(65 + j), "datasource": ds, "expr": expr, "legendFormat": legend}
                        for j, (expr, legend) in enumerate(queries)
                    ],
                }
            )
        y += 8 * -(-len(group) // 3)
    return {
        "uid": "kvwarden",
        "title": "kvwarden",
        "tags": ["kvwarden"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Prometheus",
                    "current": {"text": "Prometheus", "value": "prometheus"},
                }
            ]
        },
        "panels": panels,
    }


def panel_queries() -> list[str]:
    """Every PromQL expression of every panel, as the dashboard holds it."""
    return [expr for _, group in GROUPS for _, _, _, queries in group for expr, _ in queries]


def outputs() -> dict[Path, str]:
    def dump(doc: dict[str, Any]) -> str:
        return HEADER + yaml.safe_dump(doc, sort_keys=False, width=100, allow_unicode=True)

    board = json.dumps(dashboard(), indent=2) + "\n"
    return {RULE_TEST: dump(rule_tests()), K8S_RULE: dump(prometheus_rule()), DASHBOARD: board}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="fail if a generated file is out of date")
    ns = p.parse_args()
    stale = []
    for path, text in outputs().items():
        if ns.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print(f"out of date (run scripts/gen_deploy.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
