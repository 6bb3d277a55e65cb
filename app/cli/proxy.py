"""``kvwarden proxy``: the two-step protocol of a disaggregated prefill (`app.proxy`), served by
uvicorn until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import sys
from urllib.parse import urlsplit

EXIT_OK, EXIT_USAGE = 0, 2


def add_proxy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefill", required=True, help="the prefill engine's vLLM OpenAI server (http://host:port)"
    )
    p.add_argument(
        "--decode", required=True, help="the decode engine's vLLM OpenAI server (http://host:port)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a step may take (default 600)")


def _base(url: str, flag: str) -> str | None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/"):
        print(f"kvwarden proxy: {flag} {url!r}: expected http://host:port (no path)", file=sys.stderr)
        return None
    return url.rstrip("/")


def proxy(ns: argparse.Namespace) -> int:
    prefill, decode = _base(ns.prefill, "--prefill"), _base(ns.decode, "--decode")
    if prefill is None or decode is None:
        return EXIT_USAGE
    if not 0 < ns.port < 65536 or ns.timeout <= 0:
        print("kvwarden proxy: --port must be in 1..65535 and --timeout > 0", file=sys.stderr)
        return EXIT_USAGE
    import uvicorn

    from app.proxy import create_proxy_app

    app = create_proxy_app(prefill, decode, ns.timeout)
    uvicorn.run(app, host=ns.host, port=ns.port, log_level="warning")
    return EXIT_OK
