"""Requests generated from the OpenAPI document (hypothesis): never a 5xx, only documented
status codes, and every JSON answer matches its documented model."""

from __future__ import annotations

import json
import string
import urllib.parse
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from app import models
from app.openapi import OPENAPI_PATH
from tests.app.conftest import AUTH, TOKEN, WorkerFactory

MAX_EXAMPLES = 50
DOC: dict[str, Any] = json.loads(OPENAPI_PATH.read_text())
_TEXT = st.text(alphabet=string.ascii_letters + string.digits + "-_.~%+ é", min_size=1, max_size=30).filter(
    lambda s: s.strip(".") != ""
)


def _param_strategy(schema: dict[str, Any], known: list[int]) -> st.SearchStrategy[str]:
    kind = schema.get("type")
    if kind == "integer":
        lo = schema.get("minimum", -(1 << 70))
        hi = schema.get("exclusiveMaximum", schema.get("maximum", 1 << 70) + 1)
        return st.one_of(
            st.integers(lo, hi - 1),
            st.integers(),
            st.sampled_from(known),
            st.sampled_from([lo, hi - 1, hi, lo - 1]),
            _TEXT,
        ).map(str)
    if kind == "boolean":
        return st.one_of(st.sampled_from(["true", "false", "1", "0", "yes", "off"]), _TEXT)
    return _TEXT


def _validator(schema: dict[str, Any]) -> TypeAdapter[Any] | None:
    ref = schema.get("$ref")
    if ref is not None:
        model = getattr(models, ref.rsplit("/", 1)[-1], None)
        return None if model is None else TypeAdapter(model)
    items = schema.get("items", {}).get("$ref")
    if schema.get("type") == "array" and items is not None:
        item_model: Any = getattr(models, items.rsplit("/", 1)[-1])
        return TypeAdapter(list[item_model])  # type: ignore[valid-type]
    return None


def _check_operation(
    client: httpx.Client, path: str, method: str, op: dict[str, Any], known: list[int]
) -> None:
    params = op.get("parameters", [])
    path_params = {p["name"]: _param_strategy(p["schema"], known) for p in params if p["in"] == "path"}
    query_params = {p["name"]: _param_strategy(p["schema"], known) for p in params if p["in"] == "query"}
    auth = st.sampled_from(
        [None, AUTH["Authorization"], f"Bearer {TOKEN}-", "Bearer", "Basic abc", f"bearer {TOKEN}"]
    )
    documented = {int(code) for code in op["responses"]}

    @settings(
        max_examples=MAX_EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
    )
    @given(
        pv=st.fixed_dictionaries(path_params),
        qv=st.fixed_dictionaries({k: st.none() | v for k, v in query_params.items()}),
        authorization=auth,
    )
    def run(pv: dict[str, str], qv: dict[str, str | None], authorization: str | None) -> None:
        url = path
        for name, value in pv.items():
            url = url.replace("{" + name + "}", urllib.parse.quote(value, safe=""))
        query = {k: v for k, v in qv.items() if v is not None}
        headers = {"Authorization": authorization} if authorization else {}
        r = client.request(method.upper(), url, params=query, headers=headers)
        assert r.status_code < 500, f"{method} {url} {query}: {r.status_code} {r.text}"
        assert r.status_code in documented, f"{method} {url} {query}: {r.status_code}"
        if r.headers.get("content-type", "").startswith(("application/json", "application/health+json")):
            content: dict[str, Any] = op["responses"][str(r.status_code)].get("content", {})
            media: dict[str, Any] = next(iter(content.values()), {})
            schema: dict[str, Any] = media.get("schema", {})
            validator = _validator(schema)
            if validator is not None:
                validator.validate_python(r.json())

    run()


def test_generated_requests_never_fail_the_server(client: httpx.Client, make_worker: WorkerFactory) -> None:
    workers = [make_worker(heartbeat_interval=0.5) for _ in range(2)]
    known = [w.id for w in workers]
    operations = [(path, method, op) for path, item in DOC["paths"].items() for method, op in item.items()]
    assert len(operations) == 7
    for path, method, op in operations:
        _check_operation(client, path, method, op, known)
    # the server is still whole afterwards
    assert client.get("/health").status_code == 200
