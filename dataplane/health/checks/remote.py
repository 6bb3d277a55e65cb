"""One check per remote backend, each round (the health spec's steps):

1. A failure time is recorded (the failed-read counter tripped): healthy only once more than
   ``waiting_time_for_recovery`` has passed **and** a put-then-get probe round-trips equal bytes;
   then the failure time is cleared and the round goes on. Otherwise unhealthy.
2. Failed reads since the last round (timeouts, connection and decode errors; never a plain
   miss) >= ``get_blocking_failed_threshold``: the failure time is recorded, unhealthy.
3. Redis PING, bounded by ``health_ping_timeout``: latency and error code (0 ok, -1 timeout,
   -2 any other error, no connection included) are recorded; healthy iff the code is 0.

Refused credentials raise `IrrecoverableException`. A backend out of space (Redis answering OOM:
``maxmemory`` with ``noeviction``) passes with a warning (``warn``): writes stop, reads go on.
"""

from __future__ import annotations

from dataplane.health.base import Backend, Components, FallbackPolicy, HealthCheck, IrrecoverableException
from dataplane.storage.lower import OK, TIMEOUT
from dataplane.storage.remote import RemoteAuthError


class RemoteBackendHealthCheck(HealthCheck):
    component_type = "datastore"
    # what its reasons call a failed call, and a ping that timed out or failed
    failed_calls = "failed reads"
    ping_timed_out = "ping timed out"
    ping_failed = "ping failed (no connection or an error)"

    def __init__(self, backend_name: str, backend: Backend, components: Components) -> None:
        self.backend_name = backend_name
        self.backend = backend
        self.components = components
        self.failed_at: float | None = None
        self._reason = ""

    @classmethod
    def create(cls, components: Components) -> list[HealthCheck]:
        return [cls(name, b, components) for name, b in components.remote_backends.items()]

    def name(self) -> str:
        return f"remote_backend:{self.backend_name}:{self.backend.url}"  # the URL without a password

    @property
    def fallback_policy(self) -> FallbackPolicy:
        return self.components.fallback_policy

    def get_bypass_backend_name(self) -> str | None:
        return self.backend_name

    def reason(self) -> str:
        return self._reason

    def warning(self) -> str:
        return self.backend.space_state().describe()

    def check(self) -> bool:
        try:
            return self._check()
        except RemoteAuthError as exc:
            raise IrrecoverableException(str(exc)) from None

    def _check(self) -> bool:
        c = self.components
        now = c.clock()
        if self.failed_at is not None:
            waited = now - self.failed_at
            if waited <= c.waiting_time_for_recovery:
                self._reason = f"in the recovery window ({waited:.1f} of {c.waiting_time_for_recovery:g} s)"
                return False
            if not self.backend.probe():
                self._reason = "the recovery probe (put then get) did not round-trip"
                return False
            self.failed_at = None
        failed = self.backend.take_failed_gets()
        if failed >= c.get_blocking_failed_threshold:
            self.failed_at = now
            threshold = c.get_blocking_failed_threshold
            self._reason = f"{failed} {self.failed_calls} since the last round (threshold {threshold})"
            return False
        _, code = self.backend.ping()  # (latency and code are kept in the backend's stats)
        if code != OK:
            self._reason = self.ping_timed_out if code == TIMEOUT else self.ping_failed
            return False
        self._reason = ""
        return True
