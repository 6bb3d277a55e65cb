"""`kvwarden` command line: serve, status, reap, bench."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import types
from typing import Any, NoReturn

from pydantic import ValidationError

from dataplane.config import Settings, format_validation_error

logger = logging.getLogger("kvwarden")


class _Parser(argparse.ArgumentParser):
    """Usage errors print one line naming the problem (not the whole usage) and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _add_settings_flags(p: argparse.ArgumentParser) -> None:
    for name, f in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        ann = f.annotation
        if ann is bool:
            p.add_argument(flag, dest=name, default=None,
                           type=_parse_bool, metavar="{true,false}", help=f.description)
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
    from dataplane.runtime import build_dataplane

    # the GIL hands over every 1 ms instead of 5: a PING on the loop never waits long behind a
    # transfer or HTTP thread
    sys.setswitchinterval(0.001)
    import torch

    # copies are split across threads by the data plane's CopySplitter: one intra-op thread each
    # (an OpenMP team spinning at its barrier stalls whenever another process takes a core)
    torch.set_num_threads(1)

    try:
        dp = build_dataplane(settings)
    except Exception as exc:
        print(f"kvwarden serve: cannot start: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()

    def on_signal(signum: int, _frame: types.FrameType | None) -> None:
        logger.info("%s received, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    dp.start()
    try:
        sidecar = _start_sidecar(dp)
    except Exception as exc:
        print(f"kvwarden serve: cannot start the HTTP sidecar: {exc}", file=sys.stderr)
        dp.stop()
        return 1
    print(f"kvwarden serving on {dp.server.bound_endpoint}"
          + (f", HTTP on {sidecar.url}" if sidecar is not None else ""), flush=True)
    while not stop.wait(0.5):
        if not dp.server.is_alive():
            logger.error("kvwarden: data-plane loop died; exiting")
            break
    if sidecar is not None:
        sidecar.stop()
    clean = dp.stop()
    return 0 if clean and dp.server.loop_error is None else 1


def _start_sidecar(dp: Any) -> Any:
    try:
        from app.server import Sidecar
    except ImportError:
        return None
    sidecar = Sidecar(dp)
    sidecar.start()
    return sidecar


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="kvwarden", description="KV-cache server for LLM inference")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    ps = sub.add_parser("serve", help="run the server (data plane + HTTP sidecar)")
    _add_settings_flags(ps)
    ps.set_defaults(func=serve)
    from app import cli as http_cli  # standard library only: `status` and `reap` start fast

    pst = sub.add_parser("status", help="show a running server's /status")
    http_cli.add_status_args(pst)
    pst.set_defaults(func=http_cli.status)
    pr = sub.add_parser(
        "reap", help="release a tracked instance now (admin; token from KVWARDEN_ADMIN_TOKEN)",
        description="Exit codes: 0 reaped (or found, with --dry-run), 2 bad usage or id, "
                    "3 not tracked, 4 unauthorised or forbidden, 1 other errors.")
    http_cli.add_reap_args(pr)
    pr.set_defaults(func=http_cli.reap)
    pb = sub.add_parser("bench", help="benchmarks")
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["bench"]:  # it imports torch: only when asked, so `status` starts fast
        from dataplane.bench import add_bench_args

        add_bench_args(pb)
    ns = p.parse_args(args)
    rc: int = ns.func(ns)
    return rc



if __name__ == "__main__":
    sys.exit(main())
