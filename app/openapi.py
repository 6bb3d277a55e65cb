"""The committed OpenAPI document (`openapi/openapi.json`) and how it is rendered.

`scripts/gen_openapi.py` writes it; a test fails when the app's document drifts from it. The
document does not depend on the data plane's state, so it is rendered from an app built on a
stand-in that is never called.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

from fastapi import FastAPI

OPENAPI_PATH = Path(__file__).resolve().parent.parent / "openapi" / "openapi.json"


def render_openapi(app: FastAPI) -> str:
    """Deterministic text: sorted keys, two-space indent, trailing newline."""
    return json.dumps(app.openapi(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


class _Unused:
    """Stands in for the data plane while only the schema is read; any use is a bug."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"the OpenAPI stand-in data plane has no {name!r}")


def _no_checks(_dp: Any) -> list[Any]:
    return []


def openapi_text() -> str:
    from app.main import create_app
    from dataplane.server.facade import DataPlaneView

    return render_openapi(create_app(cast(DataPlaneView, _Unused()), check_providers=[_no_checks]))
