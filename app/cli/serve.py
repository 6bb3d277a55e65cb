"""`kvwarden serve`: parse the settings, assemble the data plane and the sidecar, run until a
signal. The main thread owns SIGTERM and SIGINT and turns them into an orderly stop.

At start it also raises the soft limit on open files to the hard limit (logged), checks that the
data plane's connection cap fits under it (exit 2 naming the setting otherwise), puts the log
rate limiter of `app.logs` on the root logger's handlers (and reports suppressed lines while it
runs), and warns about every bind address beyond loopback.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import resource
import signal
import socket
import sys
import threading
import types
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from app import logs
from dataplane.server.config import SWITCH_INTERVAL_S, Settings, fd_limit, format_validation_error

logger = logging.getLogger("kvwarden")

SECURITY_DOC = "docs/security.md"


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
    limiters = logs.install()
    try:
        return _run(settings, limiters)
    finally:
        logs.uninstall(limiters)  # reports what is still suppressed


def _run(settings: Settings, limiters: list[logs.RateLimitFilter]) -> int:
    raise_fd_limit()
    try:
        cap = settings.connection_cap(fd_limit())
    except ValueError as exc:
        print(f"kvwarden serve: invalid setting: {exc}", file=sys.stderr)
        return 2
    log_connection_cap(settings.max_connections, cap)
    warn_if_descriptors_short(settings.max_instances, cap)
    warn_if_exposed(settings)
    # bound and answering HELLO and PING before torch is even imported (a staged start:
    # `dataplane.server.early`); every other request waits for the data plane
    from dataplane.server.early import StartGate
    from dataplane.server.factory import new_server

    try:
        server = new_server(settings)
    except OSError as exc:
        print(f"kvwarden serve: cannot start: {exc}", file=sys.stderr)
        return 1
    server.start_early(StartGate(server.info(settings.chunk_size), server.metrics))
    # imported here, not at the top: `kvwarden status` and `reap` start without torch
    from app.server import Sidecar
    from dataplane.server.gcfreeze import CollectorFreezer
    from dataplane.server.runtime import build_dataplane

    _tune_process()
    try:
        dp = build_dataplane(settings, server=server)
    except Exception as exc:
        server.stop()
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
    # Everything loaded so far (torch, pydantic, the app) lives as long as the process, and so do
    # the objects of every registered instance: each full collection's survivors are frozen out
    # of the collector's sight (`CollectorFreezer`). A full pass walked ~200,000 objects at start
    # (~90 ms idle, ~450 ms under load, GIL held) and ~120,000 more at 10,000 instances (35-60 ms).
    freezer = CollectorFreezer()
    freezer.start()
    print(f"kvwarden serving on {dp.server.bound_endpoint}, HTTP on {sidecar.url}", flush=True)
    while not stop.wait(0.5):
        for limiter in limiters:
            limiter.flush_expired()
        if not dp.server.is_alive():
            logger.error("kvwarden: data-plane loop died; exiting")
            break
    sidecar.stop()
    clean = dp.stop()
    freezer.stop()
    freezer.join()
    return 0 if clean and dp.server.loop_error is None else 1


def raise_fd_limit() -> None:
    """Raise the soft limit on open files (RLIMIT_NOFILE) to the hard limit, and log both: every
    worker connection, mapping and HTTP client takes a descriptor, and 1,024 (a common default
    soft limit) is soon spent."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if target == resource.RLIM_INFINITY:  # Linux refuses an infinite NOFILE: take the kernel's cap
        try:
            target = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            target = soft
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as exc:
            logger.warning(
                "open files (RLIMIT_NOFILE): cannot raise the soft limit %d to %d: %s", soft, target, exc
            )
            return
        logger.info(
            "open files (RLIMIT_NOFILE): soft limit raised from %d to %d (hard limit %s)",
            soft,
            target,
            _lim(hard),
        )
    else:
        logger.info("open files (RLIMIT_NOFILE): soft limit %s (hard limit %s)", _lim(soft), _lim(hard))


def log_connection_cap(asked: int, cap: int) -> None:
    """Say what the data plane's connection cap is, and why when it is below the setting (the
    default, lowered to fit the open-files limit: `Settings.connection_cap`)."""
    if cap < asked:
        logger.warning(
            "max_connections: %d data-plane connections at most, not %d: the open-files limit "
            "(RLIMIT_NOFILE) %d holds no more beside the instances' mappings; raise it (ulimit -n)",
            cap,
            asked,
            fd_limit(),
        )
    else:
        logger.info("max_connections: %d data-plane connections at most; more are refused", cap)


def warn_if_descriptors_short(max_instances: int, max_connections: int) -> None:
    """Each tracked instance holds one or two descriptors (a mapping, a pool), and registrations
    keep free those the connection cap still allows: say so at start when the limit cannot hold
    ``max_instances`` beside them (registrations past it are refused, not fatal)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    need = 2 * max_instances + max_connections + 128
    if soft != resource.RLIM_INFINITY and soft < need:
        logger.warning(
            "open files (RLIMIT_NOFILE): the limit %d is below the %d that max_instances %d beside "
            "max_connections %d may need; registrations are refused (LIMIT_EXCEEDED) while fewer "
            "than 128 are free beyond the connections the cap still allows",
            soft,
            need,
            max_instances,
            max_connections,
        )


def _lim(v: int) -> str:
    return "unlimited" if v == resource.RLIM_INFINITY else str(v)


def warn_if_exposed(settings: Settings) -> None:
    """A WARNING for each bind address beyond loopback: neither socket authenticates its peers
    (only the admin routes ask for a token)."""
    binds = [("http_host", settings.http_host, "the HTTP sidecar")]
    if settings.zmq_endpoint.startswith("tcp://"):  # an ipc:// endpoint is a file, not an address
        binds.insert(0, ("host", settings.host, "the data plane (ZMQ)"))
    for setting, host, what in binds:
        if not is_loopback(host):
            logger.warning(
                "%s=%s binds beyond loopback: any host that can reach this address can speak to %s; see %s",
                setting,
                host,
                what,
                SECURITY_DOC,
            )


def is_loopback(host: str) -> bool:
    """True when every address ``host`` names is a loopback address (a name is resolved; one
    that does not resolve, ``*`` and an interface name count as beyond loopback)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    addrs = {str(info[4][0]).split("%")[0] for info in infos}
    return bool(addrs) and all(ipaddress.ip_address(a).is_loopback for a in addrs)


def _tune_process() -> None:
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # (why: its comment in dataplane.server.config)
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
