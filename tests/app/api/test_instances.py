"""GET /instances and /instances/{id}: the instance objects of /status; 404 and 422."""

from __future__ import annotations

import httpx
import pytest

from app.models import InstancePublic
from tests.app.conftest import WorkerFactory


def test_instances_lists_every_tracked_instance(client: httpx.Client, make_worker: WorkerFactory) -> None:
    assert client.get("/instances").json() == []
    a, b = make_worker(model="a"), make_worker(model="b")
    r = client.get("/instances")
    assert r.status_code == 200
    got = {i.instance_id: i for i in map(InstancePublic.model_validate, r.json())}
    assert set(got) == {a.id, b.id}
    assert (got[a.id].model_name, got[b.id].model_name) == ("a", "b")
    status_ids = {i["instance_id"] for i in client.get("/status").json()["instances"]}
    assert status_ids == set(got)


def test_instance_by_id(client: httpx.Client, make_worker: WorkerFactory) -> None:
    w = make_worker(model="llama")
    r = client.get(f"/instances/{w.id}")
    assert r.status_code == 200
    inst = InstancePublic.model_validate(r.json())
    assert (inst.instance_id, inst.model_name, inst.memory) == (w.id, "llama", "shm")


def test_unknown_instance_is_404(client: httpx.Client, make_worker: WorkerFactory) -> None:
    w = make_worker()
    other = (w.id + 1) % (1 << 63)
    r = client.get(f"/instances/{other}")
    assert r.status_code == 404
    assert r.json() == {"detail": f"instance {other} is not tracked"}


@pytest.mark.parametrize(
    "bad",
    [
        "abc",
        "-1",
        str(-(1 << 63)),
        str(1 << 63),  # the first id past the 63-bit range
        str(1 << 64),
        "1e3",
        "1.5",
        "0x10",
    ],
)
def test_instance_id_not_an_integer_in_range_is_422(client: httpx.Client, bad: str) -> None:
    r = client.get(f"/instances/{bad}")
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == ["path", "instance_id"]
    assert error["input"] == bad
    assert isinstance(error["msg"], str) and isinstance(error["type"], str)


@pytest.mark.parametrize("edge", [0, (1 << 63) - 1])
def test_instance_id_at_the_range_edges_is_404_when_untracked(
    client: httpx.Client, make_worker: WorkerFactory, edge: int
) -> None:
    w = make_worker()
    assert w.id != edge
    r = client.get(f"/instances/{edge}")
    assert (r.status_code, r.json()) == (404, {"detail": f"instance {edge} is not tracked"})


def test_instance_id_with_a_slash_is_a_routing_404(client: httpx.Client, make_worker: WorkerFactory) -> None:
    # not a 422: the server decodes %2F before routing, so /instances/<id>/2 is a path no route
    # serves, and the router answers its own 404 before any id is parsed
    w = make_worker()
    r = client.get(f"/instances/{w.id}%2F2")
    assert (r.status_code, r.json()) == (404, {"detail": "Not Found"})


def test_instance_id_empty_redirects_to_the_list(client: httpx.Client) -> None:
    # not a 422: /instances/ has no id segment at all; the list route is /instances and the
    # router redirects the trailing-slash form to it (httpx does not follow redirects here)
    r = client.get("/instances/")
    assert r.status_code == 307
    assert r.headers["location"] == str(client.base_url.join("/instances"))
