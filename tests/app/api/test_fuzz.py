"""Requests generated from the OpenAPI document (hypothesis): never a 5xx, only documented
status codes and media types, and every JSON answer (422s included) matches its documented
schema in the committed document."""

from __future__ import annotations

import json
import string
import urllib.parse
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.openapi import OPENAPI_PATH
from tests.app.conftest import AUTH, TOKEN, WorkerFactory

MAX_EXAMPLES = 50
JSON_MEDIA_TYPES = ("application/json", "application/health+json")
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


# JSON Schema keywords that only annotate; every other keyword the document uses is checked
_ANNOTATIONS = frozenset({"title", "description", "default"})
_CHECKED = frozenset(
    {"$ref", "type", "enum", "const", "anyOf", "properties", "required", "items", "additionalProperties"}
)
_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def conforms(value: Any, schema: dict[str, Any], where: str = "body") -> None:
    """Assert that ``value`` (decoded JSON) matches ``schema`` of the committed OpenAPI
    document, its ``$ref``s resolved there. A keyword this checker does not know fails the
    test rather than pass unchecked."""
    ref = schema.get("$ref")
    if ref is not None:
        assert ref.startswith("#/components/schemas/"), ref
        conforms(value, DOC["components"]["schemas"][ref.rsplit("/", 1)[-1]], where)
        return
    unknown = set(schema) - _ANNOTATIONS - _CHECKED
    assert not unknown, f"{where}: schema keywords not checked here: {sorted(unknown)}"
    if "anyOf" in schema:
        problems = []
        for alternative in schema["anyOf"]:
            try:
                conforms(value, alternative, where)
                break
            except AssertionError as exc:
                problems.append(str(exc))
        else:
            raise AssertionError(f"{where}: {value!r} matches no alternative: {problems}")
    if "type" in schema:
        assert _TYPES[schema["type"]](value), f"{where}: {value!r} is not of type {schema['type']}"
    if "enum" in schema:
        assert value in schema["enum"], f"{where}: {value!r} not in {schema['enum']}"
    if "const" in schema:
        assert value == schema["const"], f"{where}: {value!r} != {schema['const']!r}"
    if isinstance(value, dict):
        missing = [name for name in schema.get("required", []) if name not in value]
        assert not missing, f"{where}: missing required {missing}"
        properties: dict[str, Any] = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in properties:
                conforms(item, properties[key], f"{where}.{key}")
            elif isinstance(extra, dict):
                conforms(item, extra, f"{where}.{key}")
            else:
                assert extra is True, f"{where}: unexpected property {key!r}"
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            conforms(item, schema["items"], f"{where}[{i}]")


def check_response(op: dict[str, Any], r: httpx.Response) -> None:
    """A documented status, a documented media type, and a body of the documented schema.
    A 422 is also FastAPI's validation error in full: at least one error, each naming one of
    the operation's own parameters (the documented schema alone would pass ``{}``)."""
    assert str(r.status_code) in op["responses"], f"undocumented status {r.status_code}: {r.text}"
    content: dict[str, Any] = op["responses"][str(r.status_code)].get("content", {})
    media_type = r.headers.get("content-type", "").split(";")[0].strip()
    assert media_type in content, f"{r.status_code}: media type {media_type!r} is not one of {list(content)}"
    if media_type not in JSON_MEDIA_TYPES:
        return
    body = r.json()
    conforms(body, content[media_type]["schema"], f"{r.status_code} body")
    if r.status_code == 422:
        params = {(p["in"], p["name"]) for p in op.get("parameters", [])}
        assert body.get("detail"), f"422 without errors: {body}"
        for error in body["detail"]:
            if error["loc"][0] == "body" and "requestBody" in op:
                continue  # (its body: a missing or malformed one)
            assert tuple(error["loc"][:2]) in params, f"422 names no parameter of the operation: {error}"


def _check_operation(
    client: httpx.Client, path: str, method: str, op: dict[str, Any], known: list[int]
) -> None:
    params = op.get("parameters", [])
    path_params = {p["name"]: _param_strategy(p["schema"], known) for p in params if p["in"] == "path"}
    query_params = {p["name"]: _param_strategy(p["schema"], known) for p in params if p["in"] == "query"}
    auth = st.sampled_from(
        [None, AUTH["Authorization"], f"Bearer {TOKEN}-", "Bearer", "Basic abc", f"bearer {TOKEN}"]
    )

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
        check_response(op, r)

    run()


def _validation_error_operations() -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (path, method, op)
        for path, item in DOC["paths"].items()
        for method, op in item.items()
        if "422" in op["responses"]
    ]


def test_generated_requests_never_fail_the_server(client: httpx.Client, make_worker: WorkerFactory) -> None:
    workers = [make_worker(heartbeat_interval=0.5) for _ in range(2)]
    known = [w.id for w in workers]
    operations = [(path, method, op) for path, item in DOC["paths"].items() for method, op in item.items()]
    assert len(operations) == 9
    for path, method, op in operations:
        _check_operation(client, path, method, op, known)
    # hypothesis draws at random and may miss a 422 (the reap route validates its id only once
    # the token passed); so that a 422 body is checked on every run, each operation that
    # documents one also gets an id that is not an integer, with the token
    with_422 = _validation_error_operations()
    assert {(path, method) for path, method, _ in with_422} == {
        ("/instances/{instance_id}", "get"),
        ("/instances/{instance_id}/reap", "post"),
        ("/v1/lookup", "post"),  # (its body: none here)
        ("/v1/cache/clear", "post"),  # (likewise)
    }
    for path, method, op in with_422:
        r = client.request(method.upper(), path.replace("{instance_id}", "not-an-id"), headers=AUTH)
        assert r.status_code == 422, r.text
        check_response(op, r)
    # the server is still whole afterwards
    assert client.get("/health").status_code == 200


def _response(status: int, body: Any, media_type: str = "application/json") -> httpx.Response:
    return httpx.Response(status, content=json.dumps(body).encode(), headers={"content-type": media_type})


GOOD_422 = {
    "detail": [
        {
            "type": "int_parsing",
            "loc": ["path", "instance_id"],
            "msg": "Input should be a valid integer, unable to parse string as an integer",
            "input": "x",
        }
    ]
}


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param({}, id="no-detail"),
        pytest.param({"detail": []}, id="no-errors"),
        pytest.param({"detail": "bad id"}, id="detail-not-a-list"),
        pytest.param({"detail": [{"loc": ["path", "instance_id"], "msg": "m"}]}, id="error-without-type"),
        pytest.param({"detail": [{"loc": ["path", "instance_id"], "type": "t"}]}, id="error-without-msg"),
        pytest.param({"detail": [{"loc": "instance_id", "msg": "m", "type": "t"}]}, id="loc-not-a-list"),
        pytest.param({"detail": [{"loc": [["path"]], "msg": "m", "type": "t"}]}, id="loc-item-neither"),
        pytest.param({"detail": [{"loc": ["path", "instance_id"], "msg": 3, "type": "t"}]}, id="msg-not-str"),
        pytest.param({"detail": [{"loc": ["query", "nope"], "msg": "m", "type": "t"}]}, id="not-a-param"),
        pytest.param({"detail": [{**GOOD_422["detail"][0], "ctx": "ge=0"}]}, id="ctx-not-an-object"),
    ],
)
def test_the_response_check_rejects_a_malformed_422(bad: dict[str, Any]) -> None:
    op = DOC["paths"]["/instances/{instance_id}"]["get"]
    check_response(op, _response(422, GOOD_422))  # the yardstick passes a well-formed one
    with pytest.raises(AssertionError):
        check_response(op, _response(422, bad))


def test_the_response_check_rejects_undocumented_answers() -> None:
    op = DOC["paths"]["/instances/{instance_id}"]["get"]
    with pytest.raises(AssertionError, match="undocumented status 401"):
        check_response(op, _response(401, {"detail": "x"}))
    with pytest.raises(AssertionError, match="media type 'text/plain'"):
        check_response(op, _response(422, GOOD_422, "text/plain"))
    with pytest.raises(AssertionError, match="missing required"):
        check_response(op, _response(404, {"message": "x"}))
