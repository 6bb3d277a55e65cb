"""What the tests that start real vLLM engines share (vLLM's CPU build, run with the Python of
``.venv-vllm``, which ``make test`` sets up).

An engine takes about half a minute to start on two cores, so the engines are started as few
times as the tests need: the model, its two LoRA adapters and every prompt's reference output
(greedy, from an engine without kvwarden) come from one process per session, ``vllm_reference.py``,
run by the ``reference`` fixture (``tests/e2e/conftest.py``) for every case of
``REFERENCE_CASES``. The model is a tiny random-weight Llama built here (no download); prompts
are token ids.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import numpy as np
import pytest
import torch

from dataplane.wire.kinds import KVFormat
from kvbench.procs import free_port, stop_process
from kvbench.vllm import EngineProcess
from tests.helpers import ROOT, ServerProcess, subprocess_env

VLLM_PYTHON = Path(os.environ.get("KVWARDEN_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
CHUNK = 256  # the server's chunk size: two of vLLM's 128-token CPU blocks
FULL = 4 * CHUNK  # what a hit of a 1,100-token prompt loads: every full chunk but the last token's
ENGINE_LORA = {"max_lora_rank": 8, "max_loras": 2}  # both adapters stay loaded (1: swapped in turn)
# Every engine with LoRA computes on the same number of cores (vLLM keeps one more from an engine
# with a KV connector): another number of threads may sum in another order, and flip a near tie.
RESERVED_CPUS = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
# Engines start with their engine core and worker in one process (`kvbench.vllm_engine`): about a
# third of the time vLLM's own three processes take to start on two cores, and what the tests
# compare (outputs, bytes, hits) does not depend on it. The connector's halves in processes of
# their own, as `vllm serve` runs them, are tested by test_vllm (its engines), test_vllm_handoff and
# test_install (vLLM's OpenAI server).
ONE_PROCESS = {"KVWARDEN_ENGINE_ONE_PROCESS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def cpu_format(dtype: str = "bfloat16", block_size: int = 128) -> KVFormat:
    """The format vLLM's CPU engines here register dense KV in: `KVFormat.VLLM_CPU_AMX` where
    its attention runs on AMX tiles (vLLM's rule: the CPU has them, bfloat16, blocks of a
    multiple of 32), else `KVFormat.VLLM_CPU`."""
    amx = torch.cpu._is_amx_tile_supported() and dtype == "bfloat16" and block_size % 32 == 0
    return KVFormat.VLLM_CPU_AMX if amx else KVFormat.VLLM_CPU


# test_vllm's prompts: 4 full chunks of PROMPT may be loaded (of 1,099 tokens)
_rng = np.random.default_rng(11)
PROMPT = [int(x) for x in _rng.integers(3, 1000, 1100)]
SHARES_ONE = PROMPT[:CHUNK] + [int(x) for x in _rng.integers(3, 1000, 700)]  # only chunk 0 in common
FRESH = [int(x) for x in _rng.integers(3, 1000, 1100)]  # stored just before an engine quits
# test_isolation's prompts
_rng = np.random.default_rng(23)
LORA_PROMPT = [int(x) for x in _rng.integers(3, 1000, 1100)]
SALTED = [int(x) for x in _rng.integers(3, 1000, 1100)]  # the cache_salt test's own prompt


class Case(NamedTuple):
    prompt: list[int]
    salt: str | None = None
    adapter: str | None = None  # "a" or "b"


REFERENCE_CASES: dict[str, Case] = {
    # test_vllm
    "prompt": Case(PROMPT),
    "shares_one": Case(SHARES_ONE),
    "fresh": Case(FRESH),
    # test_isolation
    "base": Case(LORA_PROMPT),
    "a": Case(LORA_PROMPT, adapter="a"),
    "b": Case(LORA_PROMPT, adapter="b"),
    "salted": Case(SALTED),
    "salted:tenant-a": Case(SALTED, salt="tenant-a"),
    "salted:tenant-a:a": Case(SALTED, salt="tenant-a", adapter="a"),
}


class Models(NamedTuple):
    model: Path
    adapters: dict[str, Path]  # adapter name: its directory


class Reference(NamedTuple):
    models: Models
    tokens: dict[str, list[int]]  # each case's greedy output, from an engine without kvwarden


def require_vllm() -> None:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: `make vllm-env` sets up vLLM's environment (make test does)")


def lora(models: Models, name: str, engine: int) -> dict[str, Any]:
    """The LoRA request for adapter ``name`` as engine ``engine`` (0: the one without kvwarden, 1 or
    2) numbers it: each engine its own ids, as separate engines do."""
    ids = {"a": (1, 1, 2), "b": (2, 2, 1)}
    return {"name": f"adapter-{name}", "id": ids[name][engine], "path": str(models.adapters[name])}


def engine(
    model: Path,
    url: str | None,
    log_dir: Path,
    settings: dict[str, float] | None = None,
    lora_on: bool = False,
    one_process: bool = True,
) -> EngineProcess:
    """A vLLM engine process; kvwarden's connector (retrying fast) when ``url`` is given, with
    ``settings`` as more of its ``kvwarden.*`` settings (``{"connect_wait_s": 0.5}``).
    ``lora_on``: LoRA on (``ENGINE_LORA``) and ``RESERVED_CPUS``, like the reference engine.
    ``one_process``: the engine core and worker in the engine's process (`ONE_PROCESS`)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"engine-{time.monotonic_ns()}.log"
    extra = {"kvwarden.retry_s": 0.5, **{f"kvwarden.{k}": v for k, v in (settings or {}).items()}}
    if not lora_on:
        return EngineProcess(VLLM_PYTHON, model, url, log, extra, one_process=one_process)
    return EngineProcess(
        VLLM_PYTHON,
        model,
        url,
        log,
        extra,
        env_extra=RESERVED_CPUS,
        lora=ENGINE_LORA,
        one_process=one_process,
    )


def server(tmp: Path, port: int = 0, http_port: int = 0) -> ServerProcess:
    """A ``kvwarden serve`` for the engines (not waited for: ``serve`` waits)."""
    return ServerProcess(
        tmp,
        "--chunk-size",
        str(CHUNK),
        "--l1-size-gb",
        "0.5",
        "--worker-disconnect-grace-seconds",
        "2",
        port=port,
        http_port=http_port,
    )


def serve(tmp: Path) -> ServerProcess:
    srv = server(tmp)
    try:
        srv.wait_ready()
    except BaseException:
        srv.stop()
        raise
    return srv


def _status(srv: ServerProcess) -> dict[str, Any]:
    out: dict[str, Any] = httpx.get(f"http://127.0.0.1:{srv.http_port}/status", timeout=10).json()
    return out


def instances(srv: ServerProcess) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = _status(srv)["instances"]
    return out


def l1_chunks(srv: ServerProcess) -> int:
    return int(_status(srv)["storage"]["l1"]["chunks"])


def reaped(srv: ServerProcess) -> dict[str, float]:
    """``kvwarden_instances_reaped_total`` by reason, from the server's /metrics."""
    text = httpx.get(f"http://127.0.0.1:{srv.http_port}/metrics", timeout=10).text
    head = 'kvwarden_instances_reaped_total{reason="'
    return {
        line[len(head) :].split('"', 1)[0]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(head)
    }


def model_with_tokenizer(reference: Reference, tmp: Path) -> Path:
    """The test model, copied with a tokenizer (vLLM's OpenAI server loads one): one word a
    token, ``w<id>`` (`kvbench.vllm_model.build_tokenizer`)."""
    model = tmp / "model"
    shutil.copytree(reference.models.model, model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    code = f"from kvbench.vllm_model import build_tokenizer; build_tokenizer({str(model)!r}, {vocab})"
    subprocess.run([str(VLLM_PYTHON), "-c", code], cwd=ROOT, env=subprocess_env(), check=True, timeout=300)
    return model


def words_to_ids(text: str) -> list[int]:
    """Token ids of a text of that tokenizer's words."""
    return [int(w[1:]) for w in text.split()]


class OpenAIServer:
    """A vLLM OpenAI server (vLLM's CPU build, its prefix cache off, prompt token details on)
    with kvwarden's connector in ``role`` against the kvwarden at ``endpoint``; stopped by
    ``stop``."""

    def __init__(
        self, model: Path, endpoint: str, role: str, log: Path, extra: dict[str, Any] | None = None
    ) -> None:
        from kvbench.serve.stack import _wait_vllm

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        connector = {
            "kv_connector": "KVWardenConnector",
            "kv_connector_module_path": "dataplane.client.vllm",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"kvwarden.url": endpoint, **(extra or {})},
        }
        cmd = [
            str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager",
            "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
            "--kv-transfer-config", json.dumps(connector),
        ]  # fmt: skip
        env = subprocess_env(**RESERVED_CPUS, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
            )
        try:
            _wait_vllm(self.proc, self.url, log, 600)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        stop_process(self.proc, 60.0)
