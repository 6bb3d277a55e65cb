"""Process-level hardening of `kvwarden serve`, in process: the log rate limiter (on an injected
clock), the settings ``http_max_connections`` and ``admin_token_file``, the admin token file
driving the real admin route of the real app, the audit lines through the limiter, the
open-files limit and the warning on exposed binds. The sidecar's connection limit and idle
deadline are tested on real servers, in tests/e2e/test_serve_limits.py."""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import resource
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from pydantic import SecretStr, ValidationError

from app import logs
from app.cli import load_settings
from app.cli.serve import is_loopback, raise_fd_limit, warn_if_exposed
from dataplane.client import WorkerAdapter, allocate_kv_caches
from dataplane.server.config import Settings, format_validation_error
from dataplane.server.runtime import DataPlane
from tests.app.conftest import AUTH, LAYOUT, AppFactory, DataPlaneFactory, WorkerFactory
from tests.helpers import FakeClock

FILE_TOKEN = "token-from-a-file"


@pytest.fixture(autouse=True)
def _no_kvwarden_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("KVWARDEN_"):
            monkeypatch.delenv(k)


# --------------------------------------------------------------------- the rate limiter


class Captured:
    """A real logger whose one real handler writes to a string, with a limiter installed."""

    def __init__(self, name: str, clock: FakeClock, burst: int = 3, window_s: float = 10.0) -> None:
        self.stream = io.StringIO()
        self.logger = logging.getLogger(name)
        self.logger.propagate = False
        self.logger.setLevel(logging.DEBUG)
        self.handler = logging.StreamHandler(self.stream)
        self.handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self.logger.addHandler(self.handler)
        [self.limiter] = logs.install(burst=burst, window_s=window_s, clock=clock, logger=self.logger)

    def lines(self) -> list[str]:
        return self.stream.getvalue().splitlines()

    def close(self) -> None:
        logs.uninstall([self.limiter], logger=self.logger)
        self.logger.removeHandler(self.handler)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def cap(clock: FakeClock, request: pytest.FixtureRequest) -> Iterator[Captured]:
    c = Captured(f"kvw-test.{request.node.name}", clock)
    yield c
    c.close()


def test_limiter_passes_a_burst_then_reports_the_rest_when_the_window_ends(
    cap: Captured, clock: FakeClock
) -> None:
    for i in range(10):
        cap.logger.warning("accept failed on fd %d", i)
    assert cap.lines() == [f"WARNING {cap.logger.name}: accept failed on fd {i}" for i in range(3)]
    clock.advance(9.9)
    cap.limiter.flush_expired()
    assert len(cap.lines()) == 3  # the window has not ended: nothing reported yet
    clock.advance(0.1)
    cap.limiter.flush_expired()
    assert cap.lines()[3:] == [
        f"WARNING {cap.logger.name}: suppressed 7 similar messages: accept failed on fd %d"
    ]
    cap.limiter.flush_expired()
    assert len(cap.lines()) == 4  # reported once
    cap.logger.warning("accept failed on fd %d", 99)  # a new window
    clock.advance(60)
    cap.limiter.flush_expired()
    cap.limiter.flush()  # nothing suppressed in it: nothing reported
    assert cap.lines()[4:] == [f"WARNING {cap.logger.name}: accept failed on fd 99"]


def test_limiter_kinds_are_logger_template_and_level(cap: Captured, clock: FakeClock) -> None:
    other = logging.getLogger(cap.logger.name + ".child")  # propagates to cap's handler
    for _ in range(5):
        cap.logger.warning("a %s", "x")
        cap.logger.error("a %s", "x")
        cap.logger.warning("b %s", "x")
        other.warning("a %s", "x")
    assert len(cap.lines()) == 4 * 3
    clock.advance(10)
    cap.logger.info("anything")  # any record reports the windows that ended
    summaries = [ln for ln in cap.lines() if "suppressed" in ln]
    kinds = [("WARNING", cap.logger.name, "a"), ("ERROR", cap.logger.name, "a")]
    kinds += [("WARNING", cap.logger.name, "b"), ("WARNING", other.name, "a")]
    want = [f"{level} {name}: suppressed 2 similar messages: {t} %s" for level, name, t in kinds]
    assert sorted(summaries) == sorted(want)
    assert cap.lines()[-1] == f"INFO {cap.logger.name}: anything"


def test_limiter_exempt_records_always_pass_and_are_not_counted(cap: Captured, clock: FakeClock) -> None:
    for _ in range(20):
        cap.logger.warning("audit %s", "ok", extra={logs.NO_RATE_LIMIT: True})
    assert len(cap.lines()) == 20
    for _ in range(3):
        cap.logger.warning("audit %s", "refused")
    assert len(cap.lines()) == 23  # the exempt ones did not use up the burst
    cap.logger.warning("audit %s", "refused")
    assert len(cap.lines()) == 23
    clock.advance(10)
    cap.limiter.flush_expired()
    assert cap.lines()[-1].endswith("suppressed 1 similar messages: audit %s")


def test_limiter_flush_reports_open_windows_and_tracebacks_are_limited(cap: Captured) -> None:
    for _ in range(50):
        try:
            raise OSError(24, "Too many open files")
        except OSError:
            cap.logger.exception("socket.accept() out of system resource")
    assert cap.stream.getvalue().count("Traceback") == 3
    cap.limiter.flush()
    assert cap.lines()[-1].endswith("suppressed 47 similar messages: socket.accept() out of system resource")


def test_limiter_groups_preformatted_messages_that_differ_in_numbers(cap: Captured) -> None:
    for i in range(5):  # as asyncio reports a failed callback: a timer's deadline, an address
        cap.logger.error(f"Exception in callback when={1000 + i}.5 at 0x{i:x}ff\nhandle: <TimerHandle>")
    assert cap.stream.getvalue().count("Exception in callback") == 3
    cap.limiter.flush()
    assert cap.lines()[-1].endswith(
        "suppressed 2 similar messages: Exception in callback when=1000.5 at 0x0ff"
    )


def test_limiter_table_is_bounded(clock: FakeClock) -> None:
    out: list[logging.LogRecord] = []
    f = logs.RateLimitFilter(out.append, burst=1, window_s=10.0, clock=clock, max_kinds=4)
    rec = [logging.LogRecord("x", logging.WARNING, __file__, 1, f"msg {c}", (), None) for c in "abcdef"]
    assert f.filter(rec[0]) and not f.filter(rec[0])
    for r in rec[1:]:  # the fifth kind closes the oldest window early, and reports it
        assert f.filter(r)
    assert [r.getMessage() for r in out] == ["suppressed 1 similar messages: msg a"]
    with pytest.raises(ValueError, match="burst"):
        logs.RateLimitFilter(print, burst=0)
    with pytest.raises(ValueError, match="window_s"):
        logs.RateLimitFilter(print, window_s=0)


# ----------------------------------------------------------------------------- settings


def rejected(**kw: Any) -> str:
    with pytest.raises(ValidationError) as exc:
        Settings(**kw)
    msg = format_validation_error(exc.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize(("v", "ok"), [(0, 0), (-1, 0), (65537, 0), ("many", 0), (1, 1), (8, 1), (65536, 1)])
def test_http_max_connections_bounds(v: Any, ok: int) -> None:
    if ok:
        assert Settings(http_max_connections=v).http_max_connections == v
    else:
        assert rejected(http_max_connections=v).startswith("http_max_connections")


def test_http_max_connections_default_flag_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().http_max_connections == 256
    monkeypatch.setenv("KVWARDEN_HTTP_MAX_CONNECTIONS", "64")
    assert Settings().http_max_connections == 64
    ns = argparse.Namespace(http_max_connections="8", cmd="serve")
    assert load_settings(ns).http_max_connections == 8


def secret_of(s: Settings) -> str | None:
    secret = s.admin_secret()
    return None if secret is None else secret.get_secret_value()


def token_file(directory: Path, text: str = FILE_TOKEN + "\n", mode: int = 0o600) -> Path:
    path = directory / "admin-token"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_admin_token_file_first_line_stripped(tmp_path: Path) -> None:
    path = token_file(tmp_path, f"  {FILE_TOKEN}  \nsecond line ignored\n", 0o400)
    s = Settings(admin_token_file=path)
    assert s.admin_token is None and secret_of(s) == FILE_TOKEN
    assert FILE_TOKEN not in repr(s) and FILE_TOKEN not in str(s)


def test_admin_secret_from_either_source_or_none() -> None:
    assert secret_of(Settings()) is None
    assert secret_of(Settings(admin_token=SecretStr("t"))) == "t"


def test_admin_token_file_through_flags_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = token_file(tmp_path)
    ns = argparse.Namespace(admin_token_file=str(path), cmd="serve")
    assert secret_of(load_settings(ns)) == FILE_TOKEN
    monkeypatch.setenv("KVWARDEN_ADMIN_TOKEN_FILE", str(path))
    assert secret_of(Settings()) == FILE_TOKEN
    monkeypatch.setenv("KVWARDEN_ADMIN_TOKEN", "another")
    assert "not both" in rejected()


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o610, 0o601])
def test_admin_token_file_open_to_group_or_other_rejected(tmp_path: Path, mode: int) -> None:
    msg = rejected(admin_token_file=token_file(tmp_path, mode=mode))
    assert msg.startswith("admin_token_file: ") and f"mode {mode:04o}" in msg
    assert "owner only" in msg and "chmod 600" in msg


def test_admin_token_file_rules(tmp_path: Path) -> None:
    assert "No such file" in rejected(admin_token_file=tmp_path / "absent")
    assert "regular file" in rejected(admin_token_file=tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    assert "regular file" in rejected(admin_token_file=fifo)  # refused, without blocking
    for text in ("", "\n", "   \nsecond\n"):
        msg = rejected(admin_token_file=token_file(tmp_path, text))
        assert msg.startswith("admin_token_file: ") and "empty" in msg


def test_admin_token_and_token_file_together_rejected(tmp_path: Path) -> None:
    msg = rejected(admin_token="t", admin_token_file=token_file(tmp_path))
    assert msg == "admin_token and admin_token_file: give one of them, not both"


# -------------------------------------------- the token file drives the real admin route


@contextlib.contextmanager
def registered(dp: DataPlane) -> Iterator[WorkerAdapter]:
    """A WorkerAdapter registered on ``dp`` (its caches in real shared memory); closed after."""
    w = WorkerAdapter(dp.server.bound_endpoint, model_name="m", heartbeat_interval=10.0, request_timeout=10.0)
    try:
        w.register_kv_caches(allocate_kv_caches(*LAYOUT, dtype=torch.bfloat16))
        yield w
    finally:
        w.close()


def test_admin_token_file_drives_the_admin_route(
    make_dp: DataPlaneFactory, serve_app: AppFactory, tmp_path: Path
) -> None:
    dp = make_dp(admin_token=None, admin_token_file=token_file(tmp_path))
    c = serve_app(dp)
    with registered(dp) as w:
        assert c.post(f"/instances/{w.instance_id}/reap").status_code == 401
        wrong = c.post(f"/instances/{w.instance_id}/reap", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        good = {"Authorization": f"Bearer {FILE_TOKEN}"}
        assert c.post(f"/instances/{w.instance_id}/reap", headers=good).status_code == 200
        assert c.get(f"/instances/{w.instance_id}").status_code == 404


@pytest.fixture
def audit(clock: FakeClock) -> Iterator[Captured]:
    """The real audit logger, with a limiter (burst 3) on a capturing handler."""
    c = Captured("app.api.audit", clock)
    c.logger.propagate = True
    yield c
    c.close()
    c.logger.setLevel(logging.NOTSET)


def test_refused_admin_calls_are_limited_and_accepted_ones_never(
    client: httpx.Client, make_worker: WorkerFactory, audit: Captured, clock: FakeClock
) -> None:
    c = client  # conftest's data plane, its admin token given as a setting
    w = make_worker()
    wrong = {"Authorization": "Bearer nope"}
    good = AUTH
    for n in range(1, 4):  # under the limit: exactly one line per call
        assert c.post(f"/instances/{w.id}/reap", headers=wrong).status_code == 401
        assert len(audit.lines()) == n and "outcome=401" in audit.lines()[-1]
    for _ in range(5):  # past the burst: 401s and 422s (the same line) are dropped
        assert c.post(f"/instances/{w.id}/reap", headers=wrong).status_code == 401
        assert c.post("/instances/abc/reap", headers=good).status_code == 422
    assert len(audit.lines()) == 3
    for _ in range(6):  # accepted calls always pass, past any burst
        assert c.post(f"/instances/{w.id}/reap?dry_run=true", headers=good).status_code == 200
    assert len(audit.lines()) == 3 + 6
    assert all("who=admin (token ok)" in ln and "outcome=200" in ln for ln in audit.lines()[3:])
    clock.advance(10)
    audit.limiter.flush_expired()
    assert len(audit.lines()) == 3 + 6 + 1
    assert audit.lines()[-1] == (
        "WARNING app.api.audit: suppressed 10 similar messages: "
        "audit: admin %s who=%s from=%s instance=%s dry_run=%s outcome=%d%s"
    )


# ------------------------------------------------------------ open files, exposed binds


@pytest.fixture
def nofile() -> Iterator[tuple[int, int]]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    yield soft, hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_raise_fd_limit_raises_the_soft_limit_to_the_hard_one(
    nofile: tuple[int, int], caplog: pytest.LogCaptureFixture
) -> None:
    _, hard = nofile
    low = 256 if hard == resource.RLIM_INFINITY else min(256, hard - 1)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    caplog.set_level(logging.INFO, logger="kvwarden")
    raise_fd_limit()
    soft_now, hard_now = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert hard_now == hard and soft_now > low
    if hard != resource.RLIM_INFINITY:
        assert soft_now == hard
    [rec] = [r for r in caplog.records if "RLIMIT_NOFILE" in r.getMessage()]
    assert rec.levelno == logging.INFO
    assert rec.getMessage().startswith(
        f"open files (RLIMIT_NOFILE): soft limit raised from {low} to {soft_now}"
    )
    caplog.clear()
    raise_fd_limit()  # already at the hard limit: logged as it is
    [rec] = [r for r in caplog.records if "RLIMIT_NOFILE" in r.getMessage()]
    assert "raised" not in rec.getMessage() and f"soft limit {soft_now}" in rec.getMessage()


LOOPBACK = ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"]
BEYOND = ["0.0.0.0", "::", "*", "10.1.2.3", "no-such-host.invalid"]


@pytest.mark.parametrize("host", LOOPBACK + BEYOND)
def test_is_loopback(host: str) -> None:
    assert is_loopback(host) is (host in LOOPBACK)


def test_exposed_binds_warn_naming_the_address(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvwarden")
    warn_if_exposed(Settings())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    warn_if_exposed(Settings(host="0.0.0.0", http_host="::"))
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert msgs == [
        "host=0.0.0.0 binds beyond loopback: any host that can reach this address can speak to "
        "the data plane (ZMQ); see docs/security.md",
        "http_host=:: binds beyond loopback: any host that can reach this address can speak to "
        "the HTTP sidecar; see docs/security.md",
    ]
