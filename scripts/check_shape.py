#!/usr/bin/env python3
"""House rules the linters do not check: no source module over 500 lines, no function over 60,
no class name defined twice in the whole tree (one name, one meaning).

A function made of one data literal (a table) is exempt. Exits 1 naming every offender.

    python scripts/check_shape.py [dataplane app kvbench]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
_LITERALS = (ast.Dict, ast.List, ast.Tuple, ast.Set)


def _is_table(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return len(body) == 1 and isinstance(body[0], ast.Return) and isinstance(body[0].value, _LITERALS)


def check(path: Path) -> list[str]:
    text = path.read_text()
    problems = []
    n = len(text.splitlines())
    if n > MAX_MODULE_LINES:
        problems.append(f"{path}: {n} lines (at most {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES and not _is_table(node):
                problems.append(
                    f"{path}:{node.lineno}: {node.name}() is {length} lines (at most {MAX_FUNCTION_LINES})"
                )
    return problems


def class_names(files: list[Path]) -> list[str]:
    """Every class name defined in more than one place among ``files``, with its places."""
    where: dict[str, list[str]] = {}
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(f"{f}:{node.lineno}")
    return [
        f"class {name} is defined {len(places)} times: {', '.join(places)} (one name, one meaning)"
        for name, places in sorted(where.items())
        if len(places) > 1
    ]


def main(argv: list[str]) -> int:
    roots = [Path(a) for a in argv] or [Path("dataplane"), Path("app"), Path("kvbench")]
    files = [f for root in roots for f in sorted(root.rglob("*.py"))]
    problems = [p for f in files for p in check(f)] + class_names(files)
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
