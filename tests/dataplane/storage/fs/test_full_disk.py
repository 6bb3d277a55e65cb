"""The file tier on a real file system that fills up (a small tmpfs this test mounts; skipped
only where mounting is not permitted): a full disk stops writes, never reads, and never fails
the health check; writes resume once a probe finds room for the write that failed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dataplane.health.base import Components, FallbackPolicy
from dataplane.health.monitor import HealthMonitor
from dataplane.storage.fs import FileTier
from dataplane.storage.lower import OK
from tests.dataplane.storage.fs.test_tier import CHUNK, SCOPE, files, key, payload, read
from tests.helpers import FakeClock, mounted_tmpfs
from tests.helpers import fill_filesystem as fill


@pytest.fixture
def mount() -> Iterator[Path]:
    with mounted_tmpfs("4m") as d:
        yield d


@pytest.fixture
def clock() -> FakeClock:
    """The tier's clock: moved by the test (the one write a second let through as a try)."""
    return FakeClock()


@pytest.fixture
def tier(mount: Path, clock: FakeClock) -> Iterator[FileTier]:
    root = mount / "fs"
    root.mkdir()
    t = FileTier(str(root), 1 << 30, timeout_s=5.0, clock=clock)
    t.start()
    yield t
    t.stop()
    t.join()


def put(t: FileTier, i: int) -> bool:
    return t.put(SCOPE, key(i), memoryview(payload(i)))


def test_a_full_disk_stops_writes_keeps_reads_and_the_check_only_warns(
    mount: Path, tier: FileTier, clock: FakeClock
) -> None:
    assert put(tier, 0) and tier.flush(10)
    filler = fill(mount, CHUNK + 40 * 1024)  # room for one more chunk file, not two
    assert put(tier, 1) and put(tier, 2)
    for i in range(3, 6):  # the writer may have found the disk full by now: refused, or a try
        put(tier, i)
    assert tier.flush(10)
    s = tier.stats()
    assert s.space.out_of_space and "ENOSPC" in s.space.reason and s.space.episodes == 1
    assert s.puts == 2 and s.put_failures["no_space"] == 1  # the one write that found no room
    assert s.drops["no_space"] == 4  # it, and the three queued behind it: none tried the disk
    assert len(files(Path(tier.root))) == 2 and not list(Path(tier.root).rglob("*.tmp"))
    clock.advance(1.0)  # (a put above may have been this second's try, had the disk filled by then)
    assert put(tier, 6) and tier.flush(10)  # one write a second goes as a try: no room, dropped
    assert tier.stats().drops["no_space"] == 5 and tier.stats().put_failures["no_space"] == 1  # untried
    assert not put(tier, 7) and tier.stats().drops["no_space"] == 6  # refused at once, the try spent
    assert tier.take_failed_gets() == 0  # nothing toward the health check's threshold
    assert read(tier, 0) == payload(0) and read(tier, 1) == payload(1)  # what it holds is served
    assert read(tier, 2) is None and read(tier, 6) is None  # never written: a miss, not a wrong chunk

    # the probe file fits, but not the write that failed: still out of space, no flapping
    assert tier.ping()[1] == OK and tier.stats().space.out_of_space
    monitor = HealthMonitor(Components(fs_tiers={"fs": tier}), ping_interval=60)
    assert monitor.run_round() and monitor.is_healthy()
    (result,) = monitor.results()
    assert result.status == "warn" and result.name.startswith("fs_tier:")
    assert "out of space" in result.reason and "reads go on" in result.reason

    filler.unlink()  # space frees: within a second, the next write goes as a try and lands
    assert not put(tier, 8) and tier.stats().space.out_of_space  # (the try of this second is spent)
    clock.advance(1.0)
    assert put(tier, 9) and tier.flush(10) and read(tier, 9) == payload(9)
    assert not tier.stats().space.out_of_space and tier.stats().space.episodes == 1
    assert put(tier, 10) and tier.flush(10) and read(tier, 10) == payload(10)  # writes resumed
    assert monitor.run_round() and monitor.results()[0].status == "pass"


def test_a_disk_too_full_for_the_probe_file_is_out_of_space_not_an_outage(
    mount: Path, tier: FileTier
) -> None:
    assert put(tier, 0) and tier.flush(10)
    filler = fill(mount, 0)
    code = tier.ping()[1]
    s = tier.stats()
    assert code == OK and s.ping_code == OK and s.space.out_of_space and "probe file" in s.space.reason
    assert put(tier, 1) and tier.flush(10)  # the try of this second: no room shown, never tried
    assert not put(tier, 2)  # writes stop: refused at once
    s = tier.stats()
    assert s.drops["no_space"] == 2 and s.put_failures["no_space"] == 0 and read(tier, 1) is None
    assert read(tier, 0) == payload(0)
    monitor = HealthMonitor(Components(fs_tiers={"fs": tier}), ping_interval=60)
    assert monitor.run_round() and monitor.results()[0].status == "warn"
    filler.unlink()
    assert tier.ping()[1] == OK and not tier.stats().space.out_of_space
    assert put(tier, 3) and tier.flush(10) and read(tier, 3) == payload(3)


def test_the_warning_shows_at_once_and_local_cpu_never_bypasses_a_full_disk(
    mount: Path, tier: FileTier
) -> None:
    components = Components(fs_tiers={"fs": tier}, fallback_policy=FallbackPolicy.LOCAL_CPU)
    monitor = HealthMonitor(components, ping_interval=60)
    assert monitor.run_round() and monitor.results()[0].status == "pass"
    fill(mount, 0)
    assert put(tier, 0) and tier.flush(10)  # the write finds the disk full
    (result,) = monitor.results()  # no round since: the warning is read as health is
    assert result.status == "warn" and "out of space" in result.reason
    assert monitor.summary_state().results[-1].status == "warn"
    assert monitor.run_round() and monitor.is_healthy()
    assert monitor.bypassed() == {} and not tier.bypassed  # answering, so never bypassed
