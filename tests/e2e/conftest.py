"""The vLLM tests' session fixture: the model, its adapters and every reference output, made by
one process (``vllm_reference.py``) for all of them (``vllm_support`` says why)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.vllm_support import (
    ENGINE_LORA,
    ONE_PROCESS,
    REFERENCE_CASES,
    RESERVED_CPUS,
    VLLM_PYTHON,
    Models,
    Reference,
    lora,
    require_vllm,
)
from tests.helpers import ROOT, subprocess_env, wait_until

MAX_TOKENS = 8  # EngineProcess.generate's default: what the tests' engines answer
REFERENCE_S = 600.0  # building the model and adapters, starting the engine, every case


def _job(models: Models, answers: Path) -> dict[str, Any]:
    cases = {
        name: {
            "prompt": case.prompt,
            "cache_salt": case.salt,
            "lora": None if case.adapter is None else lora(models, case.adapter, 0),
        }
        for name, case in REFERENCE_CASES.items()
    }
    return {
        "model": str(models.model),
        "adapters": {k: str(v) for k, v in models.adapters.items()},
        "engine_lora": ENGINE_LORA,
        "max_tokens": MAX_TOKENS,
        "cases": cases,
        "answers": str(answers),
    }


def _end(proc: subprocess.Popen[bytes]) -> None:
    """The engine shuts down by itself once it has answered; killed (its whole process group)
    if it has not within a minute."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reference]:
    """Each case's greedy output from an engine without kvwarden (LoRA on and ``RESERVED_CPUS``,
    like the engines of test_isolation), and the model and adapters the other engines load. The
    engine's shutdown overlaps the tests; it is over by the end of the session."""
    require_vllm()
    root = tmp_path_factory.mktemp("vllm")
    models = Models(root / "tiny-llama", {"a": root / "lora-a", "b": root / "lora-b"})
    answers_path, log = root / "answers.json", root / "reference.log"
    (root / "job.json").write_text(json.dumps(_job(models, answers_path)))
    script = Path(__file__).with_name("vllm_reference.py")
    env = subprocess_env(**RESERVED_CPUS, **ONE_PROCESS, KVWARDEN_ENGINE_PREFIX_CACHING="0")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(VLLM_PYTHON), str(script), str(root / "job.json")],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
            start_new_session=True,
        )
    try:
        wait_until(
            lambda: answers_path.exists() or proc.poll() is not None,
            REFERENCE_S,
            0.2,
            what="the reference engine's answers",
        )
        assert answers_path.exists(), f"exit {proc.poll()}\n" + log.read_text(errors="replace")[-6000:]
        answers = json.loads(answers_path.read_text())
        assert set(answers) == set(REFERENCE_CASES), answers.keys()
        for name, answer in answers.items():
            assert answer["cached"] == 0, (name, answer)  # nothing to hit: no connector, no prefix caching
        yield Reference(models, {name: answer["tokens"] for name, answer in answers.items()})
    finally:
        _end(proc)
