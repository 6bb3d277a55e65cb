"""Tests marked ``bench`` (full benchmark runs, minutes long) are deselected unless asked for:
``KVWARDEN_BENCH=1`` or a ``-m`` expression that names ``bench`` (``pytest -m bench``). The smoke
test is not marked: it runs in ``make test``."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("KVWARDEN_BENCH") or "bench" in str(config.getoption("markexpr") or ""):
        return
    heavy = [i for i in items if i.get_closest_marker("bench")]
    if heavy:
        config.hook.pytest_deselected(items=heavy)
        items[:] = [i for i in items if not i.get_closest_marker("bench")]
