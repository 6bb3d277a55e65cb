"""`kvwarden serve`: parse the settings, assemble the data plane and the sidecar, run until a
signal. The main thread owns SIGTERM and SIGINT and turns them into an orderly stop."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import types
from typing import Any

from pydantic import ValidationError

from dataplane.server.config import Settings, format_validation_error

logger = logging.getLogger("kvwarden")


def add_settings_flags(p: argparse.ArgumentParser) -> None:
    for name, f in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        ann = f.annotation
        if ann is bool:
            p.add_argument(
                flag, dest=name, default=None, type=_parse_bool, metavar="{true,false}", help=f.description
            )
        else:
            p.add_argument(flag, dest=name, default=None, help=f.description)


def _parse_bool(v: str) -> bool:
    low = v.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {v!r}")


def load_settings(ns: argparse.Namespace) -> Settings:
    given: dict[str, Any] = {
        k: v for k, v in vars(ns).items() if k in Settings.model_fields and v is not None
    }
    return Settings(**given)


def serve(ns: argparse.Namespace) -> int:
    try:
        settings = load_settings(ns)
    except ValidationError as exc:
        print(f"kvwarden serve: invalid setting: {format_validation_error(exc)}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.value.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # imported here, not at the top: `kvwarden status` and `reap` start without torch
    from app.server import Sidecar
    from dataplane.server.runtime import build_dataplane

    _tune_process()
    try:
        dp = build_dataplane(settings)
    except Exception as exc:
        print(f"kvwarden serve: cannot start: {exc}", file=sys.stderr)
        return 1
    stop = _stop_on_signals()
    dp.start()
    sidecar = Sidecar(dp)
    try:
        sidecar.start()
    except Exception as exc:
        print(f"kvwarden serve: cannot start the HTTP sidecar: {exc}", file=sys.stderr)
        dp.stop()
        return 1
    print(f"kvwarden serving on {dp.server.bound_endpoint}, HTTP on {sidecar.url}", flush=True)
    while not stop.wait(0.5):
        if not dp.server.is_alive():
            logger.error("kvwarden: data-plane loop died; exiting")
            break
    sidecar.stop()
    clean = dp.stop()
    return 0 if clean and dp.server.loop_error is None else 1


def _tune_process() -> None:
    # the GIL hands over every 1 ms instead of 5: a PING on the loop never waits long behind a
    # transfer or HTTP thread
    sys.setswitchinterval(0.001)
    import torch

    # copies are split across threads by the data plane's CopySplitter: one intra-op thread each
    # (an OpenMP team spinning at its barrier stalls whenever another process takes a core)
    torch.set_num_threads(1)


def _stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT (handlers installed on the main thread)."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: types.FrameType | None) -> None:
        logger.info("%s received, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop
