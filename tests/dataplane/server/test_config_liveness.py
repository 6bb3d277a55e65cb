"""The liveness settings: the rules `validate_liveness` keeps between the reap timeout, the
registration grace and the disconnect grace, and `Settings` refusing what breaks them."""

from __future__ import annotations

import math
import os

import pytest
from pydantic import ValidationError

from dataplane.server.config import Settings, validate_liveness


@pytest.fixture
def no_kvwarden_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("KVWARDEN_"):
            monkeypatch.delenv(k)


@pytest.mark.parametrize(
    "timeout, grace, disconnect, names",
    [
        (10.0, 3600.0, 0.0, "worker_reap_timeout_seconds"),
        (29.9, 3600.0, 0.0, "worker_reap_timeout_seconds"),
        (-1.0, 3600.0, 0.0, "worker_reap_timeout_seconds"),
        (math.nan, 3600.0, 0.0, "worker_reap_timeout_seconds"),
        (math.inf, math.inf, 0.0, "worker_reap_timeout_seconds"),
        (120.0, 60.0, 0.0, "worker_registration_grace_seconds"),
        (120.0, math.nan, 0.0, "worker_registration_grace_seconds"),
        (120.0, math.inf, 0.0, "worker_registration_grace_seconds"),
        (120.0, 3600.0, 0.5, "worker_disconnect_grace_seconds"),
        (120.0, 3600.0, -1.0, "worker_disconnect_grace_seconds"),
        (120.0, 3600.0, 121.0, "worker_disconnect_grace_seconds"),
    ],
)
def test_liveness_rules_reject(timeout: float, grace: float, disconnect: float, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        validate_liveness(timeout, grace, disconnect)


@pytest.mark.parametrize(
    "timeout, grace, disconnect",
    [
        (0.0, 0.0, 0.0),
        (0.0, 0.0, 10.0),
        (30.0, 30.0, 30.0),
        (120.0, 3600.0, 10.0),
        (120.0, 120.0, 1.0),
    ],
)
def test_liveness_rules_accept(timeout: float, grace: float, disconnect: float) -> None:
    validate_liveness(timeout, grace, disconnect)


def test_rejection_message_gives_the_rule() -> None:
    with pytest.raises(ValueError) as exc:
        validate_liveness(10.0, 3600.0)
    assert ">= 30" in str(exc.value) and "heartbeat" in str(exc.value)
    with pytest.raises(ValueError) as exc:
        validate_liveness(120.0, 60.0)
    assert "warming" in str(exc.value)


@pytest.mark.usefixtures("no_kvwarden_env")
@pytest.mark.parametrize(
    "kw",
    [
        {"worker_reap_timeout_seconds": 10},
        {"worker_reap_timeout_seconds": 120, "worker_registration_grace_seconds": 60},
        {"worker_reap_timeout_seconds": -1},
        {"worker_reap_timeout_seconds": math.nan},
        {"worker_reap_timeout_seconds": math.inf},
        {"worker_registration_grace_seconds": math.inf},
    ],
)
def test_settings_reject(kw: dict[str, float]) -> None:
    with pytest.raises(ValidationError):
        Settings(**kw)  # type: ignore[arg-type]


@pytest.mark.usefixtures("no_kvwarden_env")
def test_settings_accept_zero_and_the_defaults() -> None:
    off = Settings(worker_reap_timeout_seconds=0, worker_registration_grace_seconds=0)
    assert (off.worker_reap_timeout_seconds, off.worker_registration_grace_seconds) == (0, 0)
    d = Settings()
    assert (
        d.worker_reap_timeout_seconds,
        d.worker_registration_grace_seconds,
        d.worker_disconnect_grace_seconds,
    ) == (120, 3600, 10)
