"""The in-flight index: which chunks are being stored, per store and per connection."""

from __future__ import annotations

from dataplane.storage.l1.inflight import InFlight


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_a_store_is_pending_until_each_key_lands_or_the_store_ends() -> None:
    f = InFlight()
    assert f.run([k(0)]) == 0 and f.open([]) == 0  # an empty store holds nothing
    mark = f.open([k(0), k(1), k(2)], conn_fd=7)
    assert f.run([k(0), k(1), k(2), k(3)]) == 3 and f.chunks() == 3 and f.stores() == 1
    f.landed(mark, [k(0)])
    assert f.run([k(0), k(1)]) == 0  # a run counts from the first key asked about
    assert f.run([k(1), k(2)]) == 2
    f.end(mark)  # the rest is not coming
    assert f.run([k(1)]) == 0 and f.chunks() == 0 and f.stores() == 0
    f.end(mark)  # twice, or a mark never given: nothing
    f.landed(99, [k(1)])
    f.end(0)


def test_two_stores_of_one_key_keep_it_pending_until_both_are_over() -> None:
    f = InFlight()
    a, b = f.open([k(0)], conn_fd=1), f.open([k(0), k(1)], conn_fd=2)
    f.end(a)
    assert f.run([k(0), k(1)]) == 2 and f.chunks() == 2
    f.landed(b, [k(0), k(0)])  # a key landed twice counts once
    assert f.run([k(0)]) == 0 and f.run([k(1)]) == 1


def test_a_closed_connection_ends_its_stores_at_once_and_no_other() -> None:
    f = InFlight()
    a = f.open([k(0), k(1)], conn_fd=5)
    f.open([k(1), k(2)], conn_fd=6)
    f.on_connection(5, True)  # an opening connection changes nothing
    assert f.run([k(0)]) == 1
    f.on_connection(5, False)
    assert f.run([k(0)]) == 0 and f.run([k(1), k(2)]) == 2 and f.stores() == 1
    f.landed(a, [k(1)])  # the dead store's late word changes nothing
    assert f.run([k(1)]) == 1
