"""What a health check is, what checks are given to decide (`Components`), and what one reports
(`CheckResult`).

A check is a `HealthCheck` subclass in a module of `dataplane.health.checks`; the monitor finds
it there (no registration code) and calls its ``create(components)``, which returns one check per
thing it watches, or none where it does not apply.

`CheckResult` is the one shape of a check's result: the monitor records it, the data plane's
facade (`dataplane.server.facade`) hands it on, and the sidecar's `/health`, `/status` and
`/metrics` read it, with the results of the sidecar's own checks in the same type.
"""

from __future__ import annotations

import abc
import enum
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from dataplane.storage.fs import FileTier
    from dataplane.storage.lower import SpaceState
    from dataplane.storage.remote import RemoteBackend


class FallbackPolicy(enum.StrEnum):
    RECOMPUTE = "recompute"  # a failing check makes the server unhealthy: work is recomputed
    LOCAL_CPU = "local_cpu"  # the failing backend is bypassed; L1 caches meanwhile


class IrrecoverableException(Exception):
    """A failure no retry can fix (e.g. refused credentials): the monitor stops for good and
    the server stays unhealthy."""


class Backend(Protocol):
    """A lower tier as its health check drives it (`RemoteBackend`, `FileTier`)."""

    url: str
    bypassed: bool

    def probe(self) -> bool: ...

    def ping(self) -> tuple[float, int]: ...

    def take_failed_gets(self) -> int: ...

    def withdraw_events(self) -> None: ...

    def space_state(self) -> SpaceState: ...


class LocalTier(Protocol):
    """The local CPU tier as the monitor drives it (`dataplane.storage.l1.store.L1Store`)."""

    hot_cache: bool

    def set_hot_cache(self, on: bool) -> None: ...

    def clear(self) -> int: ...


@dataclass
class Components:
    """What checks are created from, and the settings of the remote check."""

    remote_backends: Mapping[str, RemoteBackend] = field(default_factory=dict)
    fs_tiers: Mapping[str, FileTier] = field(default_factory=dict)
    local_tier: LocalTier | None = None
    # name -> the problem (None: fine); live checks of the data plane's own parts
    self_checks: Mapping[str, Callable[[], str | None]] = field(default_factory=dict)
    fallback_policy: FallbackPolicy = FallbackPolicy.RECOMPUTE
    get_blocking_failed_threshold: int = 10
    waiting_time_for_recovery: float = 300.0
    clock: Callable[[], float] = time.monotonic
    on_unhealthy: Callable[[], None] | None = None  # each time the server turns unhealthy


class HealthCheck(abc.ABC):
    # A live check is cheap and never blocks (it reads a flag): it is run whenever health is
    # read, not once a round, so what it watches is seen at once. Its policy is recompute.
    live: bool = False
    component_type: str = "component"  # what it watches, as its results name it

    @abc.abstractmethod
    def name(self) -> str: ...

    @abc.abstractmethod
    def check(self) -> bool:
        """True: healthy. An exception counts as a failure; `IrrecoverableException` stops the
        monitor."""

    @classmethod
    def create(cls, components: Components) -> list[HealthCheck]:
        """The checks of this kind for ``components`` (empty: it does not apply)."""
        return []

    @property
    def fallback_policy(self) -> FallbackPolicy:
        return FallbackPolicy.RECOMPUTE

    def should_skip(self) -> bool:
        return False

    def get_bypass_backend_name(self) -> str | None:
        """The backend to bypass while this check fails under LOCAL_CPU."""
        return None

    def reason(self) -> str:
        """Why the last check failed ("" when it passed)."""
        return ""

    def warning(self) -> str:
        """Asked after a check that passed: why what it watches serves degraded ("" when it
        serves fully). A warning is reported as ``warn`` and leaves the server healthy."""
        return ""


Status = Literal["pass", "warn", "fail"]


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One check's latest result. ``status``: ``pass``; ``warn``, failing while its backend is
    bypassed under the local_cpu policy, or passing with a warning (a tier out of space): the
    server still serves; ``fail``."""

    name: str
    status: Status
    reason: str = ""  # why it does not pass ("" when it passes)
    component_type: str = "component"  # component, system or datastore
    bypassed_backend: str | None = None  # the backend this check bypassed (local_cpu), if any
    skipped: bool = False  # the check did not run (`HealthCheck.should_skip`): it passes

    @property
    def healthy(self) -> bool:
        return self.status == "pass"

    @property
    def output(self) -> str:
        """What `/health` and `/status` show: the reason, or ``skipped``."""
        return self.reason or ("skipped" if self.skipped else "")
