"""Out-of-space episodes (`lower.WriteSpace`) on an injected clock: one warning when an episode
starts, one line when it ends, the drops and the room a probe must find in between."""

from __future__ import annotations

import logging

import pytest

from dataplane.storage.lower import WriteSpace
from tests.helpers import FakeClock


def test_an_episode_logs_once_counts_its_drops_and_ends_once(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock(100.0)
    s = WriteSpace("fs tier /x", clock)
    assert not s.out and s.state().describe() == "" and s.need() == 0
    assert not s.freed("nothing to free")  # no episode: nothing ends, nothing logged
    caplog.set_level(logging.INFO, logger="dataplane.storage.lower")
    s.ran_out("ENOSPC writing a chunk file of 4096 bytes", need=4096)
    for _ in range(5):  # every further refusal and drop of the episode stays quiet
        s.ran_out("ENOSPC writing a chunk file of 8192 bytes", need=8192)
        s.dropped()
    clock.advance(42)
    st = s.state()
    assert st.out_of_space and st.episodes == 1 and st.dropped == 5 and st.seconds == 42
    assert st.reason == "ENOSPC writing a chunk file of 4096 bytes"  # what started it
    assert s.need() == 8192  # the largest write refused: a probe must find that much room
    assert "out of space for 42 s" in st.describe() and "5 dropped" in st.describe()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "fs tier /x: out of space" in warnings[0].getMessage()
    assert s.freed("a probe found room")
    assert not s.freed("again")  # ended once
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and "writes resume (a probe found room) after 42.0 s" in infos[0]
    assert "5 writes dropped" in infos[0]
    after = s.state()
    assert not after.out_of_space and after.seconds == 0 and after.reason == "" and s.need() == 0


def test_a_second_episode_starts_afresh() -> None:
    clock = FakeClock(100.0)
    s = WriteSpace("remote tier redis://h", clock)
    s.ran_out("OOM", need=1 << 20)
    s.dropped()
    s.freed("room")
    clock.advance(10)
    s.ran_out("OOM on the probe key")
    st = s.state()
    assert st.out_of_space and st.episodes == 2 and st.dropped == 0 and s.need() == 0
    assert st.reason == "OOM on the probe key"
