"""A benchmark report's table, and the formats its cells share (`kvbench.report`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Table:
    title: str
    header: list[str]
    rows: list[list[str]]


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"
