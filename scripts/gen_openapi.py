#!/usr/bin/env python3
"""Regenerate openapi/openapi.json from the app (`make openapi`); `--check` exits 1 on drift."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.openapi import OPENAPI_PATH, openapi_text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--check", action="store_true", help="compare instead of writing")
    ns = p.parse_args(argv)
    text = openapi_text()
    if ns.check:
        current = OPENAPI_PATH.read_text() if OPENAPI_PATH.exists() else ""
        if current != text:
            print(f"{OPENAPI_PATH} is out of date: run scripts/gen_openapi.py", file=sys.stderr)
            return 1
        print(f"{OPENAPI_PATH} is up to date")
        return 0
    OPENAPI_PATH.parent.mkdir(parents=True, exist_ok=True)
    OPENAPI_PATH.write_text(text)
    print(f"wrote {OPENAPI_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
