"""The shaped link of `kvwarden bench codec --link-gbit`: a network namespace whose loopback a
token bucket holds to the rate asked for, gone once the block ends, and the Redis hits measured
inside it."""

from __future__ import annotations

import subprocess

import pytest

from kvbench.codec import _over_link
from kvbench.netns import shaped_loopback, unavailable


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def test_the_namespace_shapes_its_loopback_and_goes_away() -> None:
    assert unavailable() is None  # (root, with iproute2: make tools' machines and CI)
    with shaped_loopback(10) as inside:
        name = inside[-1]
        assert name in _namespaces()
        shown = subprocess.run([*inside, "tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True)
        assert "tbf" in shown.stdout and "rate 10Gbit" in shown.stdout, shown.stdout
    assert name not in _namespaces()
    with pytest.raises(ValueError, match="between 0 and 400"), shaped_loopback(0):
        pass


def test_redis_hits_are_measured_over_the_shaped_link() -> None:
    r = _over_link(10, 1 << 20, None, 2)
    assert r["lossless"]["stored_bytes"] < r["none"]["stored_bytes"]
    assert r["none"]["steady_s"] > 0 and r["coded_over_raw_time"] > 0
