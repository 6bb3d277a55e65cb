"""HTTP fuzzing of the sidecar with schemathesis, over the committed openapi/openapi.json, against
a live `kvwarden serve` process started with an admin token.

Every operation gets schemathesis' positive and (where it has parameters) negative cases, and
for an instance id also the id of a real registered worker; each response goes through
schemathesis' default checks (no 5xx, a documented status, content type, headers and body schema,
negative data rejected, positive data accepted, auth not ignored, ...).

First without the token (no Authorization header, or a wrong one): afterwards the worker is still
tracked (GET /instances/{id} 200), never re-registered, and the set of tracked instances is what
it was. Then a reap with the token shows that the same probe does see a state change; then every
operation again, with the token.
"""

from __future__ import annotations

import base64
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import requests
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from app.openapi import OPENAPI_PATH
from dataplane.client import WorkerAdapter, allocate_kv_caches, free_kv_caches
from tests.helpers import ServerProcess, subprocess_env, wait_until

TOKEN = "http-fuzz-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EXAMPLES = int(os.environ.get("KVWARDEN_HTTP_FUZZ_EXAMPLES", "40"))  # per operation and strategy
LAYOUT = (2, 8, 16, 2, 8)  # layers, blocks, block size, kv heads, head dim
_PRINTABLE = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=40)
# Authorization headers that do not carry the token (None: no header at all)
NO_TOKEN: st.SearchStrategy[str | None] = st.one_of(
    st.sampled_from(
        [
            None,
            "Bearer",
            "Bearer wrong",
            f"Bearer {TOKEN}-",
            f"Bearer {TOKEN[:-1]}",
            f"Basic {base64.b64encode(f'admin:{TOKEN}'.encode()).decode()}",
            f"Token {TOKEN}",
            TOKEN,
        ]
    ),
    _PRINTABLE.filter(lambda s: TOKEN not in s).map(lambda s: f"Bearer {s}"),
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(
        tmp_path_factory.mktemp("http-fuzz"),
        "--chunk-size",
        "16",
        env=subprocess_env(KVWARDEN_ADMIN_TOKEN=TOKEN),
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        rc = srv.stop()
        out = srv.output()
        assert rc == 0, f"server exited {rc}:\n{out[-5000:]}"
        assert "Traceback" not in out, out[-10000:]


@pytest.fixture(scope="module")
def worker(server: ServerProcess) -> Iterator[WorkerAdapter]:
    caches = allocate_kv_caches(*LAYOUT, dtype=torch.bfloat16)
    w = WorkerAdapter(server.endpoint, model_name="http-fuzz", heartbeat_interval=1.0, request_timeout=10.0)
    try:
        w.register_kv_caches(caches)
        yield w
    finally:
        w.close()
        free_kv_caches(caches)


@pytest.fixture(scope="module")
def schema() -> Any:
    return schemathesis.openapi.from_path(OPENAPI_PATH)


class Fuzz:
    """Runs schemathesis cases of every operation against one base URL and counts the answers."""

    def __init__(self, schema: Any, base_url: str, worker_id: int) -> None:
        self.operations = [result.ok() for result in schema.get_all_operations()]
        self.base_url = base_url
        self.worker_id = worker_id
        self.session = requests.Session()
        self.seen: Counter[tuple[str, str, int]] = Counter()  # (operation, strategy, status)

    def strategies(self, op: Any) -> dict[str, st.SearchStrategy[Any]]:
        out = {"positive": op.as_strategy(generation_mode=GenerationMode.POSITIVE)}
        if op.path_parameters or op.query:  # no parameters: nothing to negate
            out["negative"] = op.as_strategy(generation_mode=GenerationMode.NEGATIVE)
        if "instance_id" in [p.name for p in op.path_parameters]:
            out["worker"] = op.as_strategy(
                generation_mode=GenerationMode.POSITIVE, path_parameters={"instance_id": self.worker_id}
            )
        return out

    def run(self, authorization: st.SearchStrategy[str | None]) -> None:
        for op in self.operations:
            for name, strategy in self.strategies(op).items():
                self._run(op, name, strategy, authorization)

    def _run(
        self,
        op: Any,
        name: str,
        strategy: st.SearchStrategy[Any],
        authorization: st.SearchStrategy[str | None],
    ) -> None:
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        )
        @given(case=strategy, auth=authorization)
        def one(case: Any, auth: str | None) -> None:
            headers = {} if auth is None else {"Authorization": auth}
            response = case.call_and_validate(base_url=self.base_url, session=self.session, headers=headers)
            assert response.status_code < 500, f"{op.label}: {response.status_code} {response.text[:500]}"
            self.seen[(op.label, name, response.status_code)] += 1

        one()

    def close(self) -> None:
        self.session.close()


def _tracked(client: httpx.Client) -> set[int]:
    r = client.get("/instances")
    assert r.status_code == 200, r.text
    return {i["instance_id"] for i in r.json()}


def test_schemathesis_over_the_openapi_document(
    server: ServerProcess, worker: WorkerAdapter, schema: Any
) -> None:
    base_url = f"http://127.0.0.1:{server.http_port}"
    wid = worker.instance_id
    fuzz = Fuzz(schema, base_url, wid)
    assert {op.label for op in fuzz.operations} == {
        "GET /health",
        "GET /instances",
        "GET /instances/{instance_id}",
        "POST /instances/{instance_id}/reap",
        "GET /livez",
        "GET /metrics",
        "GET /status",
        "POST /v1/lookup",
        "POST /v1/cache/clear",
    }
    with httpx.Client(base_url=base_url, timeout=30.0) as client:
        before = _tracked(client)
        assert wid in before
        try:
            fuzz.run(NO_TOKEN)
            without_token = dict(fuzz.seen)
            # the reap route was fuzzed with the worker's real id, and refused every time
            reaps = {k: n for k, n in without_token.items() if k[0] == "POST /instances/{instance_id}/reap"}
            assert reaps.get(("POST /instances/{instance_id}/reap", "worker", 401), 0) > 0, reaps
            assert all(status in (401, 422) for (_, _, status) in reaps), reaps
            # no state change: the worker is still tracked, never reaped and re-registered
            r = client.get(f"/instances/{wid}")
            assert r.status_code == 200, r.text
            assert r.json()["instance_id"] == wid
            assert worker.registrations == 1
            assert _tracked(client) == before

            # the same probe sees a reap made with the token
            r = client.post(f"/instances/{wid}/reap", headers=AUTH)
            assert r.status_code == 200, r.text
            assert r.json()["reaped"] is True, r.json()
            wait_until(lambda: worker.registrations == 2, 30, what="the reaped worker to register again")

            fuzz.seen.clear()
            fuzz.run(st.just(AUTH["Authorization"]))
            with_token = dict(fuzz.seen)
        finally:
            fuzz.close()
        assert any(status == 200 for (op, _, status) in with_token if op.endswith("/reap")), with_token
        print(f"\nhttp fuzz without the token: {without_token}\nwith the token: {with_token}")
        assert client.get("/health").status_code == 200
    assert server.proc.poll() is None
