"""`kvwarden status` and `kvwarden reap` against a real sidecar (in this process), exit codes."""

from __future__ import annotations

import json

import httpx
import pytest

from app.cli import EXIT_ERROR, EXIT_NOT_FOUND, EXIT_OK, EXIT_UNAUTHORISED, EXIT_USAGE, main
from dataplane.server.runtime import DataPlane
from tests.app.conftest import TOKEN, AppFactory, DataPlaneFactory, WorkerFactory
from tests.helpers import free_port


def url_of(client: httpx.Client) -> str:
    return str(client.base_url).rstrip("/")


def test_status_json_is_the_raw_document(
    client: httpx.Client, make_worker: WorkerFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    w = make_worker()
    assert main(["status", "--url", url_of(client), "--json"]) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert [i["instance_id"] for i in doc["instances"]] == [w.id]


def test_status_table(
    client: httpx.Client, dp: DataPlane, make_worker: WorkerFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    w = make_worker(model="llama-3-8b")
    assert main(["status", "--url", url_of(client)]) == EXIT_OK
    out = capsys.readouterr().out
    assert dp.server.server_id in out and dp.server.bound_endpoint in out
    assert "healthy" in out and "reaping on" in out
    header, row = [ln for ln in out.splitlines() if "INSTANCE ID" in ln or str(w.id) in ln]
    assert header.split()[:3] == ["INSTANCE", "ID", "MODE"]
    assert row.split()[:5] == [str(w.id), "server_driven", "shm", "llama-3-8b", "0/1"]


def test_status_without_a_server_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["status", "--url", url]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("kvwarden status: cannot reach") and err.count("\n") == 1


def test_reap_exit_codes(
    client: httpx.Client,
    make_worker: WorkerFactory,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    w = make_worker()
    url = url_of(client)
    monkeypatch.setenv("KVWARDEN_ADMIN_TOKEN", TOKEN)
    assert main(["reap", str(w.id), "--url", url, "--dry-run"]) == EXIT_OK
    assert "dry run" in capsys.readouterr().out
    assert client.get(f"/instances/{w.id}").status_code == 200
    assert main(["reap", str(w.id), "--url", url]) == EXIT_OK
    assert f"instance {w.id} reaped" in capsys.readouterr().out
    assert client.get(f"/instances/{w.id}").status_code == 404
    assert main(["reap", str(w.id), "--url", url]) == EXIT_NOT_FOUND
    assert "not tracked" in capsys.readouterr().err
    for bad in ("abc", "-1", str(1 << 63)):
        assert main(["reap", bad, "--url", url]) == EXIT_USAGE
        assert "invalid instance id" in capsys.readouterr().err
    monkeypatch.setenv("KVWARDEN_ADMIN_TOKEN", "wrong")
    assert main(["reap", "1", "--url", url]) == EXIT_UNAUTHORISED
    assert "unauthorised (wrong token)" in capsys.readouterr().err
    monkeypatch.delenv("KVWARDEN_ADMIN_TOKEN")
    assert main(["reap", "1", "--url", url]) == EXIT_UNAUTHORISED
    assert "KVWARDEN_ADMIN_TOKEN" in capsys.readouterr().err
    assert main(["reap", "1", "--url", f"http://127.0.0.1:{free_port()}"]) == EXIT_ERROR
    assert "cannot reach" in capsys.readouterr().err


def test_reap_against_a_server_without_a_token_exits_4(
    make_dp: DataPlaneFactory,
    serve_app: AppFactory,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    c = serve_app(make_dp(admin_token=None))
    monkeypatch.setenv("KVWARDEN_ADMIN_TOKEN", TOKEN)
    assert main(["reap", "5", "--url", url_of(c)]) == EXIT_UNAUTHORISED
    assert "forbidden" in capsys.readouterr().err


def test_reap_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["reap"])
    assert exc.value.code == EXIT_USAGE
