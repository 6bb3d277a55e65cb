"""`InstanceEncoder`: the instance list of /status, encoded from liveness rows and a cache of
what is fixed at registration, equals the plain encoding of every instance's view; the cache
reads each instance once, follows a re-registration, forgets released instances, and skips an
instance released between its row and its entry."""

from __future__ import annotations

import json
from typing import Any

from app.core.status import InstanceEncoder, instance_view
from dataplane.server.facade import ContextEntry
from tests.app.test_fake_dataplane import FakeDataPlane, entry


class Counting(FakeDataPlane):
    def __init__(self) -> None:
        super().__init__()
        self.entry_reads = 0
        self.vanish: set[int] = set()  # ids gone between liveness_rows and context_entry

    def context_entry(self, instance_id: int) -> ContextEntry | None:
        self.entry_reads += 1
        return None if instance_id in self.vanish else super().context_entry(instance_id)


def plain(dp: FakeDataPlane) -> list[dict[str, Any]]:
    return [instance_view(e, dp.now) for e in dp.entries.values()]


def test_encodes_what_the_plain_views_say_and_reads_each_instance_once() -> None:
    dp = Counting()
    for i in range(300):
        dp.entries[i] = entry(
            i * 7919,
            registered_at=1000.0 + i / 3,
            last_seen=4000.0 + i,
            model_name=f'model "{i}" \\ ünï',  # escaped as JSON, once
            transfer_mode="engine_driven" if i % 2 else "server_driven",
            has_liveness_signal=bool(i % 3),
            disconnected=i % 5 == 0,
        )
    dp.entries = {e.instance_id: e for e in dp.entries.values()}
    enc = InstanceEncoder()
    assert json.loads(enc.encode(dp)) == plain(dp)
    assert dp.entry_reads == 300

    dp.now += 12.5  # time passes, PINGs arrive: only what changes is read again
    first = next(iter(dp.entries))
    dp.entries[first] = dp.entries[first]._replace(last_seen=5010.0, has_liveness_signal=True)
    assert json.loads(enc.encode(dp)) == plain(dp)
    assert dp.entry_reads == 300


def test_follows_re_registration_and_forgets_released_instances() -> None:
    dp = Counting()
    dp.entries = {i: entry(i, registered_at=100.0, last_seen=200.0) for i in range(2000)}
    enc = InstanceEncoder()
    enc.encode(dp)
    # instance 5 registered again (a new layout, a new model), under the same id
    dp.entries[5] = dp.entries[5]._replace(registered_at=300.0, model_name="other")
    doc = json.loads(enc.encode(dp))
    assert doc == plain(dp) and doc[5]["model_name"] == "other"
    assert dp.entry_reads == 2001
    for i in range(1, 2000):  # released: the cache lets them go
        del dp.entries[i]
    assert json.loads(enc.encode(dp)) == plain(dp)
    assert set(enc._heads) == {0}


def test_an_instance_released_meanwhile_is_left_out() -> None:
    dp = Counting()
    dp.entries = {i: entry(i, registered_at=100.0, last_seen=200.0) for i in range(4)}
    dp.vanish = {2}
    doc = json.loads(InstanceEncoder().encode(dp))
    assert [d["instance_id"] for d in doc] == [0, 1, 3]
