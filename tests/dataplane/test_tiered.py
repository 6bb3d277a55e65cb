"""TieredStore without a remote tier: the health gate and its rate-limited warnings; staging
only (hot cache off) drops what no reader holds."""

from __future__ import annotations

import logging

import pytest

from dataplane.storage import tiered
from dataplane.storage.tiered import TieredStore


def _store(t: TieredStore, key: bytes) -> None:
    buf = t.reserve(4096)
    assert buf is not None
    assert t.commit(key, buf)


def test_the_gate_closes_reads_writes_and_lookups(caplog: pytest.LogCaptureFixture) -> None:
    healthy = [True]
    t = TieredStore(1 << 20, gate=lambda: healthy[0])
    _store(t, b"k" * 16)
    assert t.writable() and t.prefix_hits([b"k" * 16]) == 1
    healthy[0] = False
    with caplog.at_level(logging.WARNING):
        for _ in range(50):
            assert not t.writable()
            assert t.prefix_hits([b"k" * 16]) == 0
            assert t.acquire_prefix([b"k" * 16]) == []
    lines = [r.message for r in caplog.records if "unhealthy (recompute)" in r.message]
    assert sorted(line.split(": ")[2].split(" ")[0] for line in lines) == ["LOOKUP", "RETRIEVE", "STORE"]
    healthy[0] = True
    bufs = t.acquire_prefix([b"k" * 16])
    assert len(bufs) == 1  # L1 kept it: open again, it is served
    t.release([b"k" * 16])


def test_warnings_resume_with_the_count_of_what_was_skipped(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    t = TieredStore(1 << 20, clock=lambda: now[0], gate=lambda: False)
    with caplog.at_level(logging.WARNING):
        for _ in range(7):
            t.writable()
        now[0] += tiered.WARN_EVERY_S
        t.writable()
    lines = [r.message for r in caplog.records if "STORE skipped" in r.message]
    assert len(lines) == 2 and "(6 more since the last warning)" in lines[1]


def test_discard_keeps_what_a_reader_holds() -> None:
    t = TieredStore(1 << 20)
    _store(t, b"a" * 16)
    _store(t, b"b" * 16)
    held = t.acquire_prefix([b"a" * 16])
    assert len(held) == 1
    assert t.discard([b"a" * 16, b"b" * 16, b"c" * 16]) == 1  # b only: a is read, c absent
    assert t.prefix_hits([b"a" * 16, b"b" * 16]) == 1
    t.release([b"a" * 16])
    assert t.discard([b"a" * 16]) == 1 and t.stats().chunks == 0
