"""Settings: every rule of the settings table, env vars, flags, and the CLI's refusal."""

from __future__ import annotations

import argparse
import math
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from app.cli import load_settings
from dataplane.server.config import FD_KEEP, Settings, format_validation_error, validate_liveness
from tests.helpers import ROOT, subprocess_env

REAP = "worker_reap_timeout_seconds"
GRACE = "worker_registration_grace_seconds"
DISC = "worker_disconnect_grace_seconds"


def rejected(**kw: Any) -> str:
    """The one-line message for settings that must be refused."""
    with pytest.raises(ValidationError) as exc:
        Settings(**kw)
    msg = format_validation_error(exc.value)
    assert "\n" not in msg
    return msg


@pytest.fixture(autouse=True)
def _no_kvwarden_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("KVWARDEN_"):
            monkeypatch.delenv(k)


def test_defaults_accepted() -> None:
    s = Settings()
    assert (s.host, s.port, s.http_host, s.http_port) == ("127.0.0.1", 5555, "127.0.0.1", 8080)
    assert s.chunk_size == 128 and s.l1_size_gb == 4.0
    assert s.max_cpu_workers == 4 and s.max_transfer_workers == 2
    assert s.remote_url is None and s.remote_timeout_seconds == 1.0 and s.local_cpu is True
    assert (getattr(s, REAP), getattr(s, GRACE), getattr(s, DISC)) == (120, 3600, 10)
    assert s.health_ping_interval == 30 and s.health_ping_timeout == 5
    assert s.get_blocking_failed_threshold == 10 and s.waiting_time_for_recovery == 300
    assert s.fallback_policy == "recompute" and s.admin_token is None
    assert s.log_level == "info"
    assert s.zmq_endpoint == "tcp://127.0.0.1:5555"
    assert s.l1_capacity_bytes == 4 << 30


def test_ipv6_endpoint() -> None:
    assert Settings(host="::1", port=6000).zmq_endpoint == "tcp://[::1]:6000"


# ------------------------------------------------------------------------- liveness rules


@pytest.mark.parametrize("v", [10, 29.9, 1, 0.001])
def test_reap_timeout_under_floor_rejected(v: float) -> None:
    msg = rejected(**{REAP: v})
    assert REAP in msg and ">= 30" in msg and "heartbeat" in msg


@pytest.mark.parametrize("v", [-1, -120, math.nan, math.inf, -math.inf])
def test_reap_timeout_negative_or_not_finite_rejected(v: float) -> None:
    assert REAP in rejected(**{REAP: v})


@pytest.mark.parametrize("v", [30, 30.5, 120, 86_400])
def test_reap_timeout_at_or_above_floor_accepted(v: float) -> None:
    assert getattr(Settings(**{REAP: v, GRACE: max(v, 3600)}), REAP) == v


def test_grace_smaller_than_timeout_rejected() -> None:
    msg = rejected(**{REAP: 120, GRACE: 60})
    assert GRACE in msg and REAP in msg and "120" in msg


@pytest.mark.parametrize("v", [math.nan, math.inf, -1])
def test_grace_not_finite_or_negative_rejected(v: float) -> None:
    assert GRACE in rejected(**{GRACE: v})


def test_grace_equal_to_timeout_accepted() -> None:
    s = Settings(**{REAP: 60, GRACE: 60})
    assert getattr(s, GRACE) == 60


def test_reaping_disabled_accepted() -> None:
    s = Settings(**{REAP: 0, GRACE: 0})
    assert getattr(s, REAP) == 0 and getattr(s, GRACE) == 0


@pytest.mark.parametrize(("reap", "disc"), [(120, 0), (120, 1), (120, 120), (0, 0), (0, 500), (30, 30)])
def test_disconnect_grace_accepted(reap: float, disc: float) -> None:
    assert getattr(Settings(**{REAP: reap, DISC: disc}), DISC) == disc


@pytest.mark.parametrize(
    ("reap", "disc"),
    [(120, 0.5), (120, -1), (120, math.nan), (120, math.inf), (120, 121), (30, 31), (0, 0.2)],
)
def test_disconnect_grace_rejected(reap: float, disc: float) -> None:
    msg = rejected(**{REAP: reap, DISC: disc})
    assert DISC in msg


def test_disconnect_grace_above_timeout_names_the_rule() -> None:
    msg = rejected(**{REAP: 60, DISC: 90})
    assert DISC in msg and f"<= {REAP} (60)" in msg


def test_validate_liveness_directly() -> None:
    validate_liveness(0, 0)
    validate_liveness(30, 30, 30)
    with pytest.raises(ValueError, match=REAP):
        validate_liveness(10, 3600)
    with pytest.raises(ValueError, match=GRACE):
        validate_liveness(120, 60)
    with pytest.raises(ValueError, match=DISC):
        validate_liveness(120, 3600, 0.5)


# -------------------------------------------------------------------------- other fields


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("chunk_size", 0),
        ("chunk_size", -1),
        ("l1_size_gb", 0),
        ("l1_size_gb", -1.0),
        ("l1_size_gb", math.nan),
        ("l1_size_gb", math.inf),
        ("max_cpu_workers", 0),
        ("max_transfer_workers", 0),
        ("port", 0),
        ("port", 70000),
        ("http_port", 0),
        ("remote_timeout_seconds", 0),
        ("remote_timeout_seconds", math.nan),
        ("health_ping_interval", 0),
        ("health_ping_interval", math.inf),
        ("health_ping_timeout", 0),
        ("health_ping_timeout", -1),
        ("get_blocking_failed_threshold", 0),
        ("waiting_time_for_recovery", -1),
        ("waiting_time_for_recovery", math.nan),
        ("fallback_policy", "retry"),
        ("remote_url", "http://example:6379"),
        ("log_level", "verbose"),
        ("host", ""),
        ("max_frame_bytes", 100),
        ("max_connections", 0),
        ("max_connections", -1),
        ("max_connections", (1 << 20) + 1),
        ("max_connections", "many"),
    ],
)
def test_field_rule(field: str, value: Any) -> None:
    msg = rejected(**{field: value})
    assert msg.startswith(field), msg


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("waiting_time_for_recovery", 0),
        ("fallback_policy", "local_cpu"),
        ("remote_url", "redis://localhost:6379/0"),
        ("remote_url", "rediss://h:1/2"),
        ("get_blocking_failed_threshold", 1),
        ("chunk_size", 1),
        ("remote_key_prefix", "team-a:kv:"),
        ("remote_write_queue_mb", 1),
    ],
)
def test_field_accepted(field: str, value: Any) -> None:
    assert getattr(Settings(**{field: value}), field) == value


def test_local_cpu_off_needs_a_lower_tier(tmp_path: Path) -> None:
    assert "local_cpu=false needs remote_url or fs_path" in rejected(local_cpu=False)
    s = Settings(local_cpu=False, remote_url="redis://127.0.0.1:6379/0")
    assert s.local_cpu is False
    assert Settings(local_cpu=False, fs_path=tmp_path, fs_size_gb=1).local_cpu is False


def test_the_file_tier_needs_an_existing_directory_and_a_size(tmp_path: Path) -> None:
    s = Settings(fs_path=tmp_path, fs_size_gb=0.5)
    assert s.fs_path == tmp_path and s.fs_size_gb == 0.5
    assert "fs_path and fs_size_gb: give both" in rejected(fs_path=tmp_path)
    assert "fs_path and fs_size_gb: give both" in rejected(fs_size_gb=2)
    assert f"fs_path '{tmp_path / 'nope'}': not a directory" in rejected(
        fs_path=tmp_path / "nope", fs_size_gb=1
    )
    f = tmp_path / "a-file"
    f.write_text("x")
    assert "not a directory" in rejected(fs_path=f, fs_size_gb=1)
    for bad in (-1, math.nan, math.inf):
        assert "fs_size_gb" in rejected(fs_path=tmp_path, fs_size_gb=bad)
    for bad in (0, -1, 601, math.nan):
        assert "fs_timeout_seconds" in rejected(fs_timeout_seconds=bad)
    assert "fs_write_queue_mb" in rejected(fs_write_queue_mb=0)


@pytest.mark.parametrize("prefix", ["", "has space", "x" * 65])
def test_remote_key_prefix_rule(prefix: str) -> None:
    assert rejected(remote_key_prefix=prefix).startswith("remote_key_prefix")


def test_unknown_setting_rejected() -> None:
    assert "bogus" in rejected(bogus=1)


@pytest.mark.parametrize("name", ["l1_eviction", "fs_eviction"])
def test_evictions_take_lru_or_lfuda_and_name_them_otherwise(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    assert getattr(Settings(), name) == "lru"
    msg = rejected(**{name: "lfu"})
    assert name in msg and "'lru' or 'lfuda'" in msg
    monkeypatch.setenv(f"KVWARDEN_{name.upper()}", "lfuda")
    assert getattr(Settings(), name) == "lfuda"


def test_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVWARDEN_WORKER_REAP_TIMEOUT_SECONDS", "60")
    monkeypatch.setenv("KVWARDEN_CHUNK_SIZE", "64")
    s = Settings()
    assert getattr(s, REAP) == 60 and s.chunk_size == 64
    monkeypatch.setenv("KVWARDEN_WORKER_REAP_TIMEOUT_SECONDS", "10")
    assert REAP in rejected()


def test_flags_win_over_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVWARDEN_WORKER_REAP_TIMEOUT_SECONDS", "10")
    monkeypatch.setenv("KVWARDEN_CHUNK_SIZE", "64")
    ns = argparse.Namespace(worker_reap_timeout_seconds="90", chunk_size=None, cmd="serve")
    s = load_settings(ns)
    assert getattr(s, REAP) == 90
    assert s.chunk_size == 64  # an absent flag leaves the env var in force


def test_connection_cap_under_the_open_files_limit() -> None:
    # unlimited, or a limit that holds it: max_connections as it is
    assert Settings().max_connections == 1024 and Settings().connection_cap(None) == 1024
    assert Settings().connection_cap(1 << 20) == 1024
    assert Settings(max_connections=5000).connection_cap(5000 + FD_KEEP) == 5000
    # the default is lowered to half of what the limit leaves beyond FD_KEEP
    assert Settings().connection_cap(1024) == (1024 - FD_KEEP) // 2 == 384
    assert Settings().connection_cap(FD_KEEP + 2) == 1
    # one that was given (flag, argument or environment) and does not fit is refused
    assert Settings(max_connections=1024 - FD_KEEP).connection_cap(1024) == 1024 - FD_KEEP
    with pytest.raises(ValueError) as exc:
        Settings(max_connections=1024 - FD_KEEP + 1).connection_cap(1024)
    msg = str(exc.value)
    assert msg.startswith(f"max_connections={1024 - FD_KEEP + 1}: cannot be honoured"), msg
    assert "open-files limit of 1024" in msg and f"at most {1024 - FD_KEEP} here" in msg, msg
    with pytest.raises(ValueError, match=r"^max_connections: the open-files limit of 257 .*ulimit -n"):
        Settings().connection_cap(FD_KEEP + 1)


def test_connection_cap_given_in_the_environment_counts_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVWARDEN_MAX_CONNECTIONS", "900")
    with pytest.raises(ValueError, match=r"^max_connections=900: cannot be honoured .* at most 768 here"):
        Settings().connection_cap(1024)
    monkeypatch.setenv("KVWARDEN_MAX_CONNECTIONS", "0")
    assert rejected().startswith("max_connections")


def test_l1_capacity_bytes() -> None:
    assert Settings(l1_size_gb=0.5).l1_capacity_bytes == 1 << 29


# ---------------------------------------------------------------------------------- CLI

KVWARDEN = Path(sys.executable).parent / "kvwarden"  # the installed console script

CLI_CASES: dict[str, tuple[list[str], str]] = {
    "chunk": (["--chunk-size", "0"], "chunk_size"),
    "grace": (
        ["--worker-reap-timeout-seconds", "120", "--worker-registration-grace-seconds", "60"],
        GRACE,
    ),
    "disconnect": (["--worker-disconnect-grace-seconds", "0.5"], DISC),
    "bool": (["--local-cpu", "maybe"], "--local-cpu"),
    "unknown": (["--no-such-setting", "1"], "--no-such-setting"),
    "max-connections": (["--max-connections", "0"], "max_connections"),
}
# runs under an open-files limit of 1,024 (soft and hard: the server cannot raise it)
CAPPED_CASES: dict[str, tuple[list[str], dict[str, str]]] = {
    "cap-flag": (["--max-connections", "5000"], {}),
    "cap-env": ([], {"KVWARDEN_MAX_CONNECTIONS": "769"}),
}


@dataclass
class CliRun:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def cli_runs() -> dict[str, CliRun]:
    """Every refused `kvwarden serve` run, started at once (each pays the interpreter start)."""
    assert KVWARDEN.exists(), f"{KVWARDEN} is not installed"
    held = [socket.socket() for _ in range(2)]
    try:
        # Hold the ports of the main case: a server that got as far as binding would fail
        # with a bind error instead of the setting's rule.
        for s in held:
            s.bind(("127.0.0.1", 0))
            s.listen()
        zmq_port, http_port = (str(s.getsockname()[1]) for s in held)
        runs: dict[str, list[str]] = {
            "reap-10": [
                str(KVWARDEN),
                "serve",
                "--worker-reap-timeout-seconds",
                "10",
                "--port",
                zmq_port,
                "--http-port",
                http_port,
            ],
            "env": [str(KVWARDEN), "serve", "--port", zmq_port, "--http-port", http_port],
        }
        envs = {name: extra for name, (_, extra) in CAPPED_CASES.items()}
        envs["env"] = {"KVWARDEN_WORKER_REAP_TIMEOUT_SECONDS": "10"}
        for name, (args, _) in CAPPED_CASES.items():  # the serve wrapper sets the limit, then execs
            wrapper = ["tests.reliability.workers", "serve", "--parent", str(os.getpid())]
            limits = ["--nofile-soft", "1024", "--nofile-hard", "1024", "--"]
            runs[name] = [
                sys.executable,
                "-m",
                *wrapper,
                *limits,
                "--port",
                zmq_port,
                "--http-port",
                http_port,
                *args,
            ]
        for name, (args, _) in CLI_CASES.items():
            runs[name] = [
                sys.executable,
                "-m",
                "app.cli",
                "serve",
                "--port",
                zmq_port,
                "--http-port",
                http_port,
                *args,
            ]
        procs = {
            name: subprocess.Popen(
                cmd,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=subprocess_env(**envs.get(name, {})),
            )
            for name, cmd in runs.items()
        }
        results = {}
        for name, proc in procs.items():
            try:
                out, err = proc.communicate(timeout=90)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
            results[name] = CliRun(proc.returncode, out, err)
        return results
    finally:
        for s in held:
            s.close()


def test_cli_refuses_short_reap_timeout_before_binding(cli_runs: dict[str, CliRun]) -> None:
    r = cli_runs["reap-10"]
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert REAP in lines[0] and ">= 30" in lines[0]
    assert "address" not in r.stderr.lower()
    assert "serving" not in r.stdout


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_cli_invalid_value(cli_runs: dict[str, CliRun], case: str) -> None:
    r = cli_runs[case]
    setting = CLI_CASES[case][1]
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert lines and setting in lines[-1], r.stderr
    if not setting.startswith("--"):  # refused by the settings rules: exactly one line
        assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert "address" not in r.stderr.lower()
    assert "serving" not in r.stdout


@pytest.mark.parametrize("case", sorted(CAPPED_CASES))
def test_cli_refuses_a_connection_cap_the_open_files_limit_cannot_honour(
    cli_runs: dict[str, CliRun], case: str
) -> None:
    r = cli_runs[case]
    asked = 5000 if case == "cap-flag" else 769
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()  # (after the log line naming the limit)
    assert [ln for ln in lines if "invalid setting" in ln] == lines[-1:], r.stderr
    assert lines[-1].startswith(f"kvwarden serve: invalid setting: max_connections={asked}: cannot be")
    assert "open-files limit of 1024" in lines[-1] and f"at most {1024 - FD_KEEP} here" in lines[-1]
    assert "Traceback" not in r.stderr and "serving" not in r.stdout
    assert "listening" not in r.stdout + r.stderr  # refused before anything binds


def test_cli_invalid_env_var(cli_runs: dict[str, CliRun]) -> None:
    r = cli_runs["env"]
    assert r.returncode != 0
    assert REAP in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("redis+cluster://10.0.0.1:7000,10.0.0.2:7000", True),
        ("redis+cluster://:pw@h:7000", True),
        ("redis+cluster://h:7000,nope", False),
        ("redis+cluster://h:99999", False),
        ("http://h:1", False),
    ],
)
def test_remote_url_forms(url: str, ok: bool) -> None:
    if ok:
        assert Settings(remote_url=url).remote_url == url
    else:
        msg = rejected(remote_url=url)
        assert msg.startswith("remote_url") and msg.count("remote_url") == 1, msg
