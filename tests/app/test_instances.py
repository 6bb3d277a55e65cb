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


@pytest.mark.parametrize("bad", ["abc", "-1", str(1 << 63), "1e3", ""])
def test_instance_id_out_of_range_is_422(client: httpx.Client, bad: str) -> None:
    r = client.get(f"/instances/{bad}")
    if bad == "":  # /instances/ : the list route does not take a trailing slash
        assert r.status_code in (307, 404)
        return
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["path", "instance_id"]
