"""`kvwarden status` and `kvwarden reap`: small HTTP clients of a running sidecar.

Standard library only (urllib), so these commands start fast and need nothing beyond the
server's own dependencies. Exit codes of ``reap``: 0 reaped (or, with ``--dry-run``, found),
2 bad usage or a bad id, 3 not tracked, 4 unauthorised or forbidden, 1 anything else
(connection failure, server error). ``status``: 0, or 1 when the server cannot be read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8080"
TOKEN_ENV = "KVWARDEN_ADMIN_TOKEN"

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_UNAUTHORISED = 4


class _HTTPFailure(Exception):
    """The server could not be reached or did not answer in time."""


def _request(method: str, url: str, headers: dict[str, str], timeout: float) -> tuple[int, bytes]:
    req = urllib.request.Request(url, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return int(exc.code), bytes(exc.read())
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise _HTTPFailure(f"cannot reach {url}: {reason}") from exc


def _detail(body: bytes) -> str:
    try:
        doc = json.loads(body)
    except ValueError:
        return body.decode(errors="replace").strip()[:200]
    if isinstance(doc, dict) and "detail" in doc:
        detail = doc["detail"]
        if isinstance(detail, list) and detail and isinstance(detail[0], dict):
            return str(detail[0].get("msg", detail))
        return str(detail)
    return str(doc)[:200]


def _base(url: str) -> str:
    return url.rstrip("/")


# ------------------------------------------------------------------------------------ status


def add_status_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help=f"sidecar URL (default {DEFAULT_URL})")
    p.add_argument("--json", action="store_true", help="print the raw /status document")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds (default 10)")


def status(ns: argparse.Namespace) -> int:
    url = _base(ns.url) + "/status"
    try:
        code, body = _request("GET", url, {"Accept": "application/json"}, ns.timeout)
    except _HTTPFailure as exc:
        print(f"kvwarden status: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if code != 200:
        print(f"kvwarden status: {url} answered HTTP {code}: {_detail(body)}", file=sys.stderr)
        return EXIT_ERROR
    try:
        doc = json.loads(body)
    except ValueError:
        print(f"kvwarden status: {url} did not answer JSON", file=sys.stderr)
        return EXIT_ERROR
    if ns.json:
        print(json.dumps(doc, indent=2))
    else:
        print(format_status(doc))
    return EXIT_OK


def _seconds(s: float) -> str:
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(s), 60)
    h, m = divmod(m, 60)
    d, h = divmod(h, 24)
    if d:
        return f"{d}d{h:02d}h{m:02d}m"
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def _remote_line(r: dict[str, Any] | None) -> str:
    if r is None:
        return "none"
    ping = {0: "ok", -1: "TIMEOUT"}.get(int(r.get("ping_error_code", 0)), "ERROR")
    return (
        f"{r['url']}{'  BYPASSED' if r['bypassed'] else ''}{_space(r)}  ping "
        f"{r.get('ping_latency_seconds', 0.0) * 1e3:.1f} ms {ping}  hits {r.get('hits', 0)}  "
        f"misses {r.get('misses', 0)} (bad values {r.get('bad_values', 0)})  failures get "
        f"{r.get('get_failures', 0)} put {r.get('put_failures', 0)}  write queue "
        f"{r.get('queue_depth', 0)} ({_bytes(r.get('queue_bytes', 0))}), dropped {r.get('dropped_writes', 0)}"
    )


def _space(tier: dict[str, Any]) -> str:
    """``  OUT OF SPACE (<seconds> s: <reason>)`` while a tier's writes are stopped, else ""."""
    s = tier.get("space") or {}
    if not s.get("out_of_space"):
        return ""
    return f"  OUT OF SPACE ({s.get('seconds', 0):.0f} s: {s.get('reason', '')}; writes stopped, reads go on)"


def _fs_line(f: dict[str, Any] | None) -> str:
    if f is None:
        return "none"
    probe = {0: "ok", -1: "TIMEOUT"}.get(int(f.get("ping_error_code", 0)), "ERROR")
    index = "" if f.get("rebuilt", True) else "  (index being rebuilt)"
    return (
        f"{f['path']}{'  BYPASSED' if f['bypassed'] else ''}{_space(f)}  {_bytes(f['used_bytes'])} of "
        f"{_bytes(f['capacity_bytes'])}  {f['files']} files{index}  probe "
        f"{f.get('ping_latency_seconds', 0.0) * 1e3:.1f} ms {probe}  hits {f.get('hits', 0)}  misses "
        f"{f.get('misses', 0)} (bad files {f.get('bad_files', 0)})  failures get {f.get('get_failures', 0)} "
        f"put {f.get('put_failures', 0)}  write queue {f.get('queue_depth', 0)}, dropped "
        f"{f.get('dropped_writes', 0)}"
    )


def format_status(doc: dict[str, Any]) -> str:
    srv = doc["server"]
    live = doc["worker_liveness"]
    health = doc["health"]
    l1 = doc["storage"]["l1"]
    remote = doc["storage"]["remote"]
    checks = ", ".join(f"{c['name']} {c['status']}" for c in health["checks"]) or "none"
    if live["enabled"]:
        reaping = (
            f"reaping on (timeout {live['reap_timeout_seconds']:g}s, grace "
            f"{live['registration_grace_seconds']:g}s, disconnect grace "
            f"{live['disconnect_grace_seconds']:g}s)"
        )
    else:
        reaping = "reaping off"
    lines = [
        f"server    {srv['server_id']}  version {srv['version']}  up {_seconds(srv['uptime_seconds'])}",
        f"zmq       {srv['zmq_endpoint']}  chunk size {srv['chunk_size']}  boot token {srv['boot_token']}",
        f"health    {'healthy' if doc['is_healthy'] else 'UNHEALTHY'}  policy "
        f"{health['fallback_policy']}  checks: {checks}",
    ]
    if health["bypassed_backends"]:
        lines.append(f"bypassed  {', '.join(health['bypassed_backends'])}")
    lines += [
        f"liveness  {reaping}  tracked {live['tracked_instances']}  reaped {live['reaped_total']}",
        f"l1        {_bytes(l1['used_bytes'])} of {_bytes(l1['capacity_bytes'])} used  "
        f"{l1['chunks']} chunks  hot cache {'on' if l1['hot_cache'] else 'off'}",
        "fs        " + _fs_line(doc["storage"].get("fs")),
        "remote    " + _remote_line(remote),
        "",
    ]
    rows = [
        [
            str(i["instance_id"]),
            i["transfer_mode"],
            i["memory"],
            i["model_name"],
            f"{i['worker_id']}/{i['world_size']}",
            _seconds(i["registered_seconds_ago"]) + " ago",
            _seconds(i["last_seen_seconds_ago"]) + " ago",
            "yes" if i["has_liveness_signal"] else "no",
            "closed" if i["disconnected"] else "open",
        ]
        for i in sorted(doc["instances"], key=lambda i: (i["model_name"], i["worker_id"], i["instance_id"]))
    ]
    headers = [
        "INSTANCE ID",
        "MODE",
        "MEMORY",
        "MODEL",
        "RANK",
        "REGISTERED",
        "LAST SEEN",
        "PINGED",
        "CONNECTION",
    ]
    lines.append(_table(headers, rows) if rows else "no tracked instances")
    return "\n".join(lines)


# -------------------------------------------------------------------------------------- reap


def add_reap_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("instance_id", help="the instance id (an integer in [0, 2^63))")
    p.add_argument("--url", default=DEFAULT_URL, help=f"sidecar URL (default {DEFAULT_URL})")
    p.add_argument("--dry-run", action="store_true", help="report without releasing")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds (default 30)")


def parse_instance_id(text: str) -> int | None:
    try:
        value = int(text.strip(), 10)
    except ValueError:
        return None
    return value if 0 <= value < (1 << 63) else None


def reap(ns: argparse.Namespace) -> int:
    iid = parse_instance_id(ns.instance_id)
    if iid is None:
        print(
            f"kvwarden reap: invalid instance id {ns.instance_id!r}: expected an integer in [0, 2^63)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    token = os.environ.get(TOKEN_ENV, "")
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    query = "?dry_run=true" if ns.dry_run else ""
    url = f"{_base(ns.url)}/instances/{iid}/reap{query}"
    try:
        code, body = _request("POST", url, headers, ns.timeout)
    except _HTTPFailure as exc:
        print(f"kvwarden reap: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if code == 200:
        try:
            result = json.loads(body)
            released = ", ".join(result["released"])
        except (ValueError, KeyError, TypeError):
            print(f"kvwarden reap: unexpected answer from {url}", file=sys.stderr)
            return EXIT_ERROR
        if ns.dry_run:
            print(
                f"kvwarden reap: instance {iid} is tracked; a reap would release it from: "
                f"{released} (dry run, nothing released)"
            )
        else:
            print(f"kvwarden reap: instance {iid} reaped (released from: {released})")
        return EXIT_OK
    if code == 404:
        print(f"kvwarden reap: instance {iid} is not tracked by the server", file=sys.stderr)
        return EXIT_NOT_FOUND
    if code == 401:
        why = "wrong token" if token else f"no token: set {TOKEN_ENV}"
        print(f"kvwarden reap: unauthorised ({why})", file=sys.stderr)
        return EXIT_UNAUTHORISED
    if code == 403:
        print(
            "kvwarden reap: forbidden: the server has no admin token configured "
            "(start it with --admin-token or KVWARDEN_ADMIN_TOKEN)",
            file=sys.stderr,
        )
        return EXIT_UNAUTHORISED
    if code == 422:
        print(f"kvwarden reap: the server rejected instance id {iid}: {_detail(body)}", file=sys.stderr)
        return EXIT_USAGE
    print(f"kvwarden reap: server answered HTTP {code}: {_detail(body)}", file=sys.stderr)
    return EXIT_ERROR
