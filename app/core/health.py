"""Health checks: a list built from pluggable check providers.

A *provider* is a callable ``provider(dp) -> Sequence[SidecarCheck]`` run once when the app is
built; it returns the checks that apply to this data plane. The default is `monitor_checks`:
the data plane's health monitor, whose checks cover its own parts (loop, pools, reaper) and the
remote tier. A *check* is cheap and non-blocking: it reads state through the data plane's
public accessors (flags and cached results: `/health` runs the checks on the event loop, so a
check must never wait on a lock, a socket or a remote backend) and returns one or more
`CheckResult`, the type the health monitor reports its own checks' results in (re-exported by
the facade), so a provider's results and the monitor's are one list. The overall status is
``fail`` when any check fails, else ``warn`` when any warns (serving, degraded: a backend
bypassed under the ``local_cpu`` fallback policy), else ``pass``. A check that raises counts as
failed. Other components add a provider to `DEFAULT_PROVIDERS` or pass their own to
`app.main.create_app`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from dataplane.server.facade import CheckResult, Status

if TYPE_CHECKING:
    from dataplane.server.facade import DataPlaneView

__all__ = [
    "DEFAULT_PROVIDERS",
    "CheckProvider",
    "CheckResult",
    "FunctionCheck",
    "HealthChecker",
    "HealthReport",
    "MonitorChecks",
    "SidecarCheck",
    "Status",
    "monitor_checks",
]

logger = logging.getLogger(__name__)


class SidecarCheck(Protocol):
    """A check the sidecar runs at every health read."""

    name: str

    def check(self) -> CheckResult | list[CheckResult]: ...


CheckProvider = Callable[["DataPlaneView"], Sequence[SidecarCheck]]


@dataclass(frozen=True, slots=True)
class HealthReport:
    status: Status
    results: list[CheckResult]
    bypassed_backends: list[str] = field(default_factory=list)

    @property
    def is_healthy(self) -> bool:
        return self.status != "fail"

    @property
    def first_problem(self) -> str:
        for r in self.results:
            if r.status != "pass":
                return f"{r.name}: {r.output}"
        return ""


@dataclass
class FunctionCheck:
    """A check from a function returning None (pass) or the reason it fails."""

    name: str
    probe: Callable[[], str | None]
    component_type: str = "component"

    def check(self) -> CheckResult:
        problem = self.probe()
        if problem is None:
            return CheckResult(self.name, "pass", component_type=self.component_type)
        return CheckResult(self.name, "fail", problem, self.component_type)


class HealthChecker:
    """Runs every check of every provider; cheap enough for each `/health` and scrape."""

    def __init__(self, dp: DataPlaneView, providers: Sequence[CheckProvider]) -> None:
        self.checks: list[SidecarCheck] = []
        for provider in providers:
            self.checks.extend(provider(dp))

    def run(self) -> HealthReport:
        results: list[CheckResult] = []
        for c in self.checks:
            try:
                got = c.check()
                results.extend(got if isinstance(got, list) else [got])
            except Exception as exc:  # a check that raises has failed
                logger.exception("health: check %s raised", c.name)
                results.append(CheckResult(c.name, "fail", f"check raised {exc!r}"))
        statuses = {r.status for r in results}
        status: Status = "fail" if "fail" in statuses else "warn" if "warn" in statuses else "pass"
        bypassed = sorted({r.bypassed_backend for r in results if r.bypassed_backend})
        return HealthReport(status, results, bypassed)


# ---------------------------------------------------------------- the health monitor's checks


@dataclass
class MonitorChecks:
    """The data plane's health monitor: its results as it reports them (its live checks, the
    data plane's own parts, are flag reads run at this read; the remote tier's are its last
    round's). A recompute check failing is ``fail``; a check whose backend is bypassed under
    local_cpu is ``warn``; init failure or an irrecoverable failure is a ``fail`` of
    ``health_monitor``, ahead of them."""

    dp: DataPlaneView
    name: str = "health_monitor"

    def check(self) -> list[CheckResult]:
        st = self.dp.monitor_state()
        out: list[CheckResult] = []
        if st.init_failure is not None:
            out.append(CheckResult(self.name, "fail", f"initialisation failed: {st.init_failure}"))
        elif st.irrecoverable is not None:
            out.append(CheckResult(self.name, "fail", f"stopped: {st.irrecoverable}"))
        out.extend(st.results)
        return out


def monitor_checks(dp: DataPlaneView) -> list[SidecarCheck]:
    return [MonitorChecks(dp)]


DEFAULT_PROVIDERS: tuple[CheckProvider, ...] = (monitor_checks,)
