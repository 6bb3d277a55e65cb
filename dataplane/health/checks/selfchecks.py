"""The data plane's own checks (loop thread, worker pools, reaper, ...): one per entry of
``Components.self_checks``, a function returning True while that part works. Recompute policy:
a data plane that cannot serve is unhealthy."""

from __future__ import annotations

from collections.abc import Callable

from dataplane.health.base import Components, HealthCheck


class DataPlaneSelfCheck(HealthCheck):
    def __init__(self, name: str, fn: Callable[[], bool]) -> None:
        self._name, self._fn = name, fn

    @classmethod
    def create(cls, components: Components) -> list[HealthCheck]:
        return [cls(name, fn) for name, fn in components.self_checks.items()]

    def name(self) -> str:
        return self._name

    def check(self) -> bool:
        return bool(self._fn())

    def reason(self) -> str:
        return f"{self._name} is not running"
