"""The `kvwarden` command line: ``serve`` (the data plane and its sidecar in one process),
``status`` and ``reap`` (small HTTP clients of a running sidecar), ``proxy`` (a disaggregated
prefill's two steps in front of two vLLM OpenAI servers), ``bench``.

Usage errors print one line naming the problem and exit 2. Only ``serve`` and ``bench`` import
torch and the data plane, so ``status`` and ``reap`` start fast.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

import dataplane
from app.cli import proxy, remote
from app.cli.remote import EXIT_ERROR, EXIT_NOT_FOUND, EXIT_OK, EXIT_UNAUTHORISED, EXIT_USAGE
from app.cli.serve import add_settings_flags, load_settings, serve

__all__ = [
    "EXIT_ERROR",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_UNAUTHORISED",
    "EXIT_USAGE",
    "load_settings",
    "main",
]


class _Parser(argparse.ArgumentParser):
    """Usage errors print one line naming the problem (not the whole usage) and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def version_line() -> str:
    """What ``kvwarden --version`` prints: which project this is, its version, and where it runs
    from, so an operator can tell it from another program of the same name on the PATH."""
    home = Path(dataplane.__file__).resolve().parent.parent
    return (
        f"kvwarden {dataplane.__version__} (distribution {dataplane.DISTRIBUTION}: "
        f"KV-cache server for LLM inference engines; installed at {home})"
    )


class _Version(argparse.Action):
    """``--version``: the line as it is (argparse's own action wraps it at the terminal's width)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS) -> None:
        super().__init__(
            option_strings,
            dest,
            nargs=0,
            default=argparse.SUPPRESS,
            help="print the project, its version and where it is installed, and exit",
        )

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(version_line())
        parser.exit(0)


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="kvwarden", description="KV-cache server for LLM inference")
    p.add_argument("--version", action=_Version)
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    ps = sub.add_parser("serve", help="run the server (data plane + HTTP sidecar)")
    add_settings_flags(ps)
    ps.set_defaults(func=serve)
    pst = sub.add_parser("status", help="show a running server's /status")
    remote.add_status_args(pst)
    pst.set_defaults(func=remote.status)
    pr = sub.add_parser(
        "reap",
        help="release a tracked instance now (admin; token from KVWARDEN_ADMIN_TOKEN)",
        description="Exit codes: 0 reaped (or found, with --dry-run), 2 bad usage or id, "
        "3 not tracked, 4 unauthorised or forbidden, 1 other errors.",
    )
    remote.add_reap_args(pr)
    pr.set_defaults(func=remote.reap)
    pp = sub.add_parser(
        "proxy",
        help="a disaggregated prefill's two steps in front of two vLLM OpenAI servers",
        description="Sends each completion to the prefill server (one token), then to the decode "
        "server with the prefill's kv_transfer_params. Exit code 2 on bad usage.",
    )
    proxy.add_proxy_args(pp)
    pp.set_defaults(func=proxy.proxy)
    pb = sub.add_parser("bench", help="benchmarks")
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["bench"]:  # it imports torch: only when asked, so `status` starts fast
        from kvbench import add_bench_args

        add_bench_args(pb)
    ns = p.parse_args(args)
    rc: int = ns.func(ns)
    return rc
