"""docs/protocol.md's example, run as written against a real `kvwarden serve`: it speaks the
protocol version the code speaks, and gets the answers its comments show."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from dataplane.wire.protocol import PROTOCOL_VERSION
from tests.helpers import ROOT, ServerProcess, subprocess_env


def example() -> str:
    doc = (ROOT / "docs" / "protocol.md").read_text()
    after = doc.split("## Example", 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_protocol_example_runs_against_a_real_server(tmp_path: Path) -> None:
    code = example()
    assert "tcp://127.0.0.1:5555" in code
    srv = ServerProcess(tmp_path)
    try:
        srv.wait_ready()
        code = code.replace("tcp://127.0.0.1:5555", srv.endpoint)
        out = subprocess.run(
            [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=60
        )
    finally:
        srv.stop()
    assert out.returncode == 0, out.stderr
    ping, lookup = (ast.literal_eval(line) for line in out.stdout.splitlines())
    assert ping[:3] == [PROTOCOL_VERSION, 7, True] and ping[3]["tracked"] is None and ping[3]["boot_token"]
    assert lookup[:3] == [PROTOCOL_VERSION, 8, False] and lookup[3]["code"] == "NOT_REGISTERED"
    comments = [line.split("# ", 1)[1] for line in code.splitlines() if line.startswith("print(")]
    assert all(c.startswith(f"[{PROTOCOL_VERSION}, ") for c in comments), comments
