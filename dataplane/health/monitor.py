"""HealthMonitor: runs every check each ``ping_interval`` on the thread ``health-monitor`` and
applies the fallback policies.

- **recompute**: a failing check makes the server unhealthy (STORE skipped, RETRIEVE all-miss,
  LOOKUP 0, by the gate of the transfer modules) until every check passes again.
- **local_cpu**: the server stays healthy; the check's backend is bypassed (no reads, no writes)
  and L1 is switched to hot-cache mode. The hot-cache setting is saved once, at the first bypass;
  when the last bypassed backend recovers it is restored, and if it was off L1 is emptied: the
  chunks written during the outage are not served as if the remote tier held them.
- A check that passes with a warning (`HealthCheck.warning`: a tier out of space) is ``warn``
  and leaves the server healthy.
- A check that raises counts as failed; `IrrecoverableException` stops the monitor for good,
  the server unhealthy, with one error line. `mark_init_failed` (storage or modules could not
  start) makes the server unhealthy for good and the monitor never starts.
- `request_round` runs a round at once (a burst of remote failures need not wait out
  ``ping_interval``).

Checks are found by `discover`: every module of `dataplane.health.checks` whose name does not
start with ``_``, every `HealthCheck` subclass defined there; a module that fails to import or a
``create`` that raises is logged and skipped.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import pkgutil
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

from dataplane.health.base import (
    CheckResult,
    Components,
    FallbackPolicy,
    HealthCheck,
    IrrecoverableException,
    Status,
)

logger = logging.getLogger(__name__)

CHECKS_PACKAGE = "dataplane.health.checks"


def discover(components: Components, package: str = CHECKS_PACKAGE) -> list[HealthCheck]:
    pkg = importlib.import_module(package)
    checks: list[HealthCheck] = []
    for mod_info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if mod_info.name.startswith("_"):
            continue
        name = f"{package}.{mod_info.name}"
        try:
            module = importlib.import_module(name)
        except Exception as exc:
            logger.error("health: cannot import check module %s: %s: %s", name, type(exc).__name__, exc)
            continue
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != name or not issubclass(cls, HealthCheck) or inspect.isabstract(cls):
                continue
            try:
                checks.extend(cls.create(components))
            except Exception as exc:
                logger.error(
                    "health: %s.create failed, check skipped: %s: %s", cls.__name__, type(exc).__name__, exc
                )
    return checks


def _passes(chk: HealthCheck) -> bool:
    """Whether a live check passes now (the gate's question: no result is built)."""
    try:
        return bool(chk.check())
    except Exception:
        return False


def _run_live(chk: HealthCheck) -> CheckResult:
    """A live check's result, now; one that raises has failed."""
    try:
        ok = bool(chk.check())
        reason = "" if ok else chk.reason()
    except Exception as exc:
        ok, reason = False, f"{type(exc).__name__}: {exc}"
    return CheckResult(chk.name(), "pass" if ok else "fail", reason, chk.component_type)


@dataclass(frozen=True, slots=True)
class MonitorState:
    """The monitor as it reads now (`HealthMonitor.summary_state`): the live checks' results,
    then each other check's last one; a failing check whose backend is bypassed is ``warn``."""

    healthy: bool
    init_failure: str | None
    irrecoverable: str | None
    rounds: int
    bypassed_backends: tuple[str, ...]
    results: tuple[CheckResult, ...]


class HealthMonitor:
    def __init__(
        self,
        components: Components,
        ping_interval: float,
        checks: Sequence[HealthCheck] | None = None,
    ) -> None:
        if ping_interval <= 0:
            raise ValueError(f"ping_interval must be > 0, got {ping_interval}")
        self.components = components
        self.ping_interval = ping_interval
        self.checks = list(checks) if checks is not None else discover(components)
        self._live = [c for c in self.checks if c.live]  # run when health is read
        self._rounds_of = [c for c in self.checks if not c.live]  # run each round
        self._by_name = {c.name(): c for c in self._rounds_of}  # (names never change)
        self._lock = threading.Lock()  # leaf: guards every field below
        self._healthy = True
        self._init_failure: str | None = None
        self._irrecoverable: str | None = None
        self._results: dict[str, CheckResult] = {}
        self._bypassed: dict[str, str] = {}  # backend -> the check that bypassed it
        self._saved_hot_cache: bool | None = None  # before the first bypass
        self._rounds = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the thread; not when there is no check or the server failed to initialise."""
        if self._thread is not None:
            raise RuntimeError("HealthMonitor already started")
        if not self._rounds_of or self.init_failed():
            return  # (live checks need no thread)
        self._thread = threading.Thread(target=self._run, name="health-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def request_round(self) -> None:
        """Run a round now instead of at the end of the interval."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_round()
            except IrrecoverableException:
                return  # run_round logged it and left the server unhealthy
            self._wake.wait(self.ping_interval)
            self._wake.clear()

    # ----------------------------------------------------------------- state
    def is_healthy(self) -> bool:
        """Read by every gated STORE, RETRIEVE and LOOKUP: the live checks run, nothing is kept."""
        with self._lock:
            ok = self._healthy and self._init_failure is None and self._irrecoverable is None
        return ok and all(_passes(chk) for chk in self._live)

    def mark_init_failed(self, reason: str) -> None:
        with self._lock:
            self._init_failure = reason
        logger.error("health: the server failed to initialise (%s): recompute-only from now on", reason)

    def init_failed(self) -> bool:
        with self._lock:
            return self._init_failure is not None

    def bypassed(self) -> dict[str, str]:
        with self._lock:
            return dict(self._bypassed)

    def results(self) -> list[CheckResult]:
        """Each round check's last result (the live checks are not kept), its warning as of now."""
        with self._lock:
            recorded = self._round_results()
        return self._warned(recorded)

    def _warned(self, results: list[CheckResult]) -> list[CheckResult]:
        """``results`` with each passing check's warning read now (`HealthCheck.warning` reads a
        flag): a tier that ran out of space shows as ``warn`` at once, not a round later. Not
        under ``_lock``, which is a leaf: a warning takes its tier's lock."""
        out = []
        for r in results:
            chk = self._by_name.get(r.name)
            if chk is None or r.status == "fail" or r.skipped or r.bypassed_backend is not None:
                out.append(r)
                continue
            try:
                warning = chk.warning()
            except Exception as exc:  # (a warning that cannot be read is one)
                warning = f"{type(exc).__name__}: {exc}"
            out.append(replace(r, status="warn" if warning else "pass", reason=warning))
        return out

    def _round_results(self) -> list[CheckResult]:
        """Under ``_lock``: each recorded result, with the backend its check bypassed."""
        by_check = {check: backend for backend, check in self._bypassed.items()}
        out = list(self._results.values())
        for i, r in enumerate(out):
            backend = by_check.get(r.name)
            if backend is not None:
                status = "warn" if r.status == "fail" else r.status
                out[i] = replace(r, status=status, bypassed_backend=backend)
        return out

    def summary_state(self) -> MonitorState:
        live = [_run_live(chk) for chk in self._live]
        with self._lock:
            healthy = self._healthy and self._init_failure is None and self._irrecoverable is None
            rounds, init_failure, irrecoverable = self._rounds, self._init_failure, self._irrecoverable
            bypassed, recorded = tuple(sorted(self._bypassed)), self._round_results()
        return MonitorState(
            healthy and all(r.healthy for r in live),
            init_failure,
            irrecoverable,
            rounds,
            bypassed,
            (*live, *self._warned(recorded)),
        )

    # ----------------------------------------------------------------- round
    def run_round(self) -> bool:
        """Every check once, then the policies; the resulting health. Raises
        IrrecoverableException (after marking the server unhealthy) when a check did."""
        healthy = True
        for chk in self._rounds_of:
            name = chk.name()
            if chk.should_skip():
                self._record(chk, name, True, skipped=True)
                continue
            try:
                ok = bool(chk.check())
                reason = chk.warning() if ok else chk.reason()
            except IrrecoverableException as exc:
                with self._lock:
                    self._irrecoverable = f"{name}: {exc}"
                    self._healthy = False
                logger.error("health: %s failed irrecoverably (%s); the monitor stops, unhealthy", name, exc)
                raise
            except Exception as exc:
                ok, reason = False, f"{type(exc).__name__}: {exc}"
            self._record(chk, name, ok, reason=reason)
            if chk.fallback_policy is FallbackPolicy.LOCAL_CPU and chk.get_bypass_backend_name():
                self._local_cpu(chk, name, ok)
            elif not ok:
                healthy = False
        with self._lock:
            was, self._healthy = self._healthy, healthy
            self._rounds += 1
        if was != healthy:
            if not healthy and self.components.on_unhealthy is not None:
                self.components.on_unhealthy()  # (KV events: nothing is served meanwhile)
            log = logger.info if healthy else logger.warning
            log("health: the server is %s", "healthy again" if healthy else "unhealthy (recompute)")
        return self.is_healthy()

    def _record(
        self, chk: HealthCheck, name: str, ok: bool, *, skipped: bool = False, reason: str = ""
    ) -> None:
        """A check's result: ``reason`` is why it failed, or, when it passed, its warning."""
        status: Status = "fail" if not ok else "warn" if reason else "pass"
        r = CheckResult(name, status, reason, chk.component_type, skipped=skipped)
        with self._lock:
            self._results[name] = r

    def _local_cpu(self, chk: HealthCheck, name: str, ok: bool) -> None:
        backend = chk.get_bypass_backend_name()
        assert backend is not None
        tier = self.components.local_tier
        target = self.components.remote_backends.get(backend) or self.components.fs_tiers.get(backend)
        restore: bool | None = None
        with self._lock:
            if not ok and backend not in self._bypassed:
                if not self._bypassed and tier is not None:
                    self._saved_hot_cache = tier.hot_cache  # once, at the first bypass
                self._bypassed[backend] = name
                bypass = True
            elif ok and self._bypassed.get(backend) == name:
                del self._bypassed[backend]
                bypass = False
                if not self._bypassed:
                    restore, self._saved_hot_cache = self._saved_hot_cache, None
            else:
                return
        if target is not None:
            target.bypassed = bypass
            if bypass:
                target.withdraw_events()  # (KV events: what it held is out of reach now)
        if bypass:
            logger.warning("health: %s failed: backend %s bypassed, L1 caches meanwhile", name, backend)
            if tier is not None:
                tier.set_hot_cache(True)
            return
        logger.info("health: %s recovered: backend %s in use again", name, backend)
        if tier is not None and restore is not None:
            tier.set_hot_cache(restore)
            if not restore:  # what L1 kept during the outage must not pass for the remote's
                dropped = tier.clear()
                logger.info(
                    "health: hot cache restored off: %d chunks kept during the outage dropped", dropped
                )
