"""`kvwarden bench vllm`: time to first token of real vLLM engines, with and without kvwarden.

On a random-weight Llama built here where prefill dominates (`kvbench.vllm_model`
``PREFILL``: hidden 1,024, 8 layers, 8 KV heads, head dim 128), a prompt of ~2,900 tokens, one
output token (so the time of a request is its time to first token). In one run, engines one
after another, each prompt new to every cache:
- **no connector**: an engine without kvwarden (nor its own prefix caching), a new prompt;
- **vLLM prefix hit**: an engine without kvwarden, its own prefix caching on, a prompt it has
  just served (the floor for any hit: nothing is copied); its first pass is shown too;
- **kvwarden miss**: an engine with kvwarden (its own prefix caching off), a new prompt
  (a LOOKUP that finds nothing, then its chunks stored off the step), on a server just started;
- **kvwarden repeat**: the same engine, the same prompt again the moment the miss answered,
  while its store may still be running (the engine copies the prefix from the first request's
  blocks, which vLLM holds until that store is over);
- **kvwarden hit**: another engine process, the prompts the previous one stored.
Every engine keeps the same cores from its worker (``--reserved-cpus``; vLLM otherwise reserves
one more core for an engine with any KV connector, which on a 2-core machine gives that engine's
worker both cores and the others one). Engines run with vLLM's CPU build in its own environment
(``--vllm-python``, default
``.venv-vllm/bin/python``: `make vllm-env`). ``EngineProcess`` is shared with the vLLM tests.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvbench.procs import bench_env, launch, wait_http
from kvbench.results import add_output_args, finish, resolve

ENGINE_START_S = 300.0
CHUNK = 256  # the server's chunk size: two of vLLM's 128-token CPU blocks


class EngineProcess:
    """One vLLM engine (`kvbench.vllm_engine`) driven over its stdin and stdout, in a
    process group of its own (``kill`` takes its engine core and worker too)."""

    def __init__(
        self,
        python: str | Path,
        model: Path,
        url: str | None,
        log: Path,
        extra: dict[str, Any] | None = None,
        prefix_caching: bool | str = False,
        env_extra: dict[str, str] | None = None,
        lora: dict[str, Any] | None = None,
        one_process: bool = False,
    ) -> None:
        """``lora``: LoRA on, with these engine options (``max_lora_rank``, ``max_loras``...);
        ``prefix_caching`` "force": vLLM's own prefix cache on even where its platform turns it
        off (MLA on its CPU backend: a comparator for tests, `kvbench.vllm_engine`);
        ``one_process``: the engine core (and one rank's worker) in the engine's process, not
        vLLM's default processes of their own (`kvbench.vllm_engine`). vLLM's log lines go to
        ``log`` (stdout is the answers' channel)."""
        env = {**os.environ, "VLLM_LOGGING_STREAM": "ext://sys.stderr", **(env_extra or {})}
        env["KVWARDEN_ENGINE_ONE_PROCESS"] = "1" if one_process else "0"
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        env["KVWARDEN_ENGINE_CONNECTOR_EXTRA"] = json.dumps(extra or {})
        env["KVWARDEN_ENGINE_PREFIX_CACHING"] = (
            "force" if prefix_caching == "force" else "1" if prefix_caching else "0"
        )
        env.pop("KVWARDEN_ENGINE_LORA", None)
        if lora is not None:
            env["KVWARDEN_ENGINE_LORA"] = json.dumps(lora)
        self.log = log
        cmd = [str(python), "-m", "kvbench.vllm_engine", str(model), url or ""]
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
                cwd=root,
                start_new_session=True,
            )
        self._buf = b""
        self.ready = self._answer(ENGINE_START_S)

    def _answer(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                if line.startswith(b"@kvw "):
                    answer: dict[str, Any] = json.loads(line[5:])
                    return answer
            left = deadline - time.monotonic()
            if left <= 0 or (self.proc.poll() is not None and not select.select([fd], [], [], 0)[0]):
                raise RuntimeError(f"vLLM engine: no answer (exit {self.proc.poll()})\n{self.tail()}")
            if select.select([fd], [], [], min(left, 0.5))[0]:
                data = os.read(fd, 65536)
                if not data:
                    raise RuntimeError(
                        f"vLLM engine closed its output (exit {self.proc.poll()})\n{self.tail()}"
                    )
                self._buf += data

    def generate(
        self,
        prompt: list[int],
        max_tokens: int = 8,
        timeout: float = 300.0,
        *,
        cache_salt: str | None = None,
        lora: dict[str, Any] | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        prompt_logprobs: bool = False,
    ) -> dict[str, Any]:
        """One request; ``lora`` is ``{"name": ..., "id": ..., "path": ...}`` (an engine with LoRA on);
        ``kv_transfer_params``: a disaggregated prefill's answer, for this decode;
        ``prompt_logprobs``: the prompt's tokens scored too (`kvbench.vllm_engine`)."""
        self.submit(
            prompt,
            max_tokens,
            cache_salt=cache_salt,
            lora=lora,
            kv_transfer_params=kv_transfer_params,
            prompt_logprobs=prompt_logprobs,
        )
        return self.result(timeout)

    def submit(
        self,
        prompt: list[int],
        max_tokens: int = 8,
        *,
        cache_salt: str | None = None,
        lora: dict[str, Any] | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        prompt_logprobs: bool = False,
    ) -> None:
        """Send a request without waiting for its answer (``result``)."""
        assert self.proc.stdin is not None
        cmd: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens}
        if prompt_logprobs:
            cmd["prompt_logprobs"] = True
        if cache_salt is not None:
            cmd["cache_salt"] = cache_salt
        if kv_transfer_params is not None:
            cmd["kv_transfer_params"] = kv_transfer_params
        if lora is not None:
            cmd["lora"] = lora
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def command(self, cmd: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
        """Another line of `kvbench.vllm_engine` (``{"reset": true}``, ``{"perturb": seed}``),
        and its answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        return self._answer(timeout)

    def result(self, timeout: float = 300.0) -> dict[str, Any]:
        """The answer to the oldest request ``submit`` sent."""
        return self._answer(timeout)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def close(self) -> None:
        """Quit (the connector shuts down: stores finish, the worker unregisters), else kill."""
        if self.proc.poll() is None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.write(b'{"quit": true}\n')
                self.proc.stdin.flush()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(60)
        self.kill()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


def default_python() -> str:
    env = os.environ.get("KVWARDEN_VLLM_PYTHON")
    if env:
        return env
    local = Path.cwd() / ".venv-vllm" / "bin" / "python"
    return str(local) if local.exists() else sys.executable


def add_args(sub: Any) -> None:
    p = sub.add_parser(
        "vllm", help="vLLM time to first token: no connector, kvwarden miss and hit, vLLM's own hit"
    )
    p.add_argument("--rounds", type=int, default=None, help="prompts per case (5; quick 2)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="default 2900")
    p.add_argument("--vllm-python", default=None, help="the Python of vLLM's environment (.venv-vllm)")
    p.add_argument(
        "--model-kind",
        choices=("dense", "mla", "gemma3"),
        default="dense",
        help="a dense Llama; a DeepSeek-V2 with multi-head latent attention (one latent a token "
        "cached; vLLM's own prefix cache kept on for it, which its CPU build turns off); or a "
        "Gemma 3 kind of sliding-window hybrid (one full-attention layer, three of a 256-token "
        "window: a hit loads each window's last chunk alone), with vLLM's hybrid manager on",
    )
    p.add_argument(
        "--reserved-cpus",
        type=int,
        default=1,
        help="cores vLLM keeps from its worker (VLLM_CPU_NUM_OF_RESERVED_CPU), the same for every engine",
    )
    add_output_args(p)
    p.set_defaults(func=run_vllm)


def engine_python(ns: argparse.Namespace) -> str | None:
    """A vLLM benchmark's sizes resolved (``--rounds``, ``--prompt-tokens``) and the Python of
    vLLM's environment; None, said on stderr, when the sizes cannot run."""
    resolve(ns, rounds=(5, 2, 1), prompt_tokens=(2900, 2900, 600))
    if ns.rounds < 1 or ns.prompt_tokens < 2 * CHUNK:
        print(f"bench: --rounds >= 1 and --prompt-tokens >= {2 * CHUNK}", file=sys.stderr)
        return None
    return str(ns.vllm_python or default_python())


def build_in(python: str, model: Path, build: str) -> None:
    """Build a random-weight model in ``model`` with vLLM's environment: ``build`` is a call of
    `kvbench.vllm_model` naming the folder as ``{path!r}``."""
    code = "from kvbench.vllm_model import *; " + build.format(path=str(model))
    subprocess.run([python, "-c", code], check=True, env=bench_env())


def run_vllm(ns: argparse.Namespace) -> int:
    python = engine_python(ns)
    if python is None:
        return 2
    from kvbench.vllm_model import MLA, PREFILL, TINY

    shape: object = TINY if ns.tiny else PREFILL
    build = f"build_model({{path!r}}, {shape!r})"
    if ns.model_kind == "mla":
        shape, build = MLA, "build_mla_model({path!r})"
    elif ns.model_kind == "gemma3":
        shape, build = "gemma3 (TINY's sizes, 4 layers)", "build_hybrid_model({path!r}, 'gemma3')"
    with tempfile.TemporaryDirectory(prefix="kvwarden-bench-vllm-") as tmp:
        work = Path(tmp)
        model = work / "model"
        build_in(python, model, build)
        env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(ns.reserved_cpus)}
        own_cache: bool | str = "force" if ns.model_kind == "mla" else True
        out = _measure(python, model, work, ns.rounds, ns.prompt_tokens, env, own_cache)
    out["params"] = {
        "rounds": ns.rounds,
        "prompt_tokens": ns.prompt_tokens,
        "model_kind": ns.model_kind,
        "model": str(shape),
        "reserved_cpus": ns.reserved_cpus,
    }
    finish(ns, "vllm", out, _show)
    return 0


def _prompts(seed: int, n: int, tokens: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(3, 1000, tokens)] for _ in range(n)]


def _serve(eng: EngineProcess, prompts: list[list[int]], cases: dict[str, list[Any]], *keys: str) -> None:
    """Each prompt once per key, one after another (the case of each pass), then quit ``eng``."""
    try:
        for p in prompts:
            for key in keys:
                cases[key].append(eng.generate(p, 1))
    finally:
        eng.close()


def _retrieved(srv: Any) -> float:
    """The bytes the server has copied out to workers (its /metrics)."""
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    head = 'kvwarden_transfer_bytes_total{direction="retrieve"}'
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(head))


def _measure(
    python: str,
    model: Path,
    work: Path,
    rounds: int,
    tokens: int,
    env: dict[str, str],
    own_cache: bool | str = True,
) -> dict[str, Any]:
    own, ours = _prompts(1, rounds, tokens), _prompts(2, rounds, tokens)
    keys = ("none", "vllm_miss", "vllm_hit", "miss", "repeat", "hit")
    cases: dict[str, list[dict[str, Any]]] = {k: [] for k in keys}
    _serve(EngineProcess(python, model, None, work / "none.log", env_extra=env), own, cases, "none")
    prefix = EngineProcess(python, model, None, work / "prefix.log", prefix_caching=own_cache, env_extra=env)
    _serve(prefix, own, cases, "vllm_miss", "vllm_hit")
    srv = launch("--chunk-size", str(CHUNK), "--l1-size-gb", "2")
    try:
        wait_http(srv)
        eng = EngineProcess(python, model, srv.endpoint, work / "miss.log", env_extra=env)
        _serve(eng, ours, cases, "miss", "repeat")
        eng = EngineProcess(python, model, srv.endpoint, work / "hit.log", env_extra=env)
        before = _retrieved(srv)
        _serve(eng, ours, cases, "hit")
        moved = _retrieved(srv) - before  # the hits' bytes, as the server counts them
    finally:
        srv.proc.terminate()
        srv.proc.wait(30)
    med = {k: statistics.median(r["s"] for r in v) for k, v in cases.items()}
    return {
        "ttft_s": med,
        "cached_tokens": {k: statistics.median(r["cached"] for r in v) for k, v in cases.items()},
        "hit_vs_vllm_hit": med["hit"] / med["vllm_hit"],
        "repeat_vs_vllm_hit": med["repeat"] / med["vllm_hit"],
        "miss_vs_none": med["miss"] / med["none"],
        "same_output": all(
            a["tokens"] == b["tokens"] for a, b in zip(cases["miss"], cases["hit"], strict=True)
        ),
        "repeat_same_as_hit": all(
            a["tokens"] == b["tokens"] for a, b in zip(cases["repeat"], cases["hit"], strict=True)
        ),
        "runs": {k: [round(r["s"], 4) for r in v] for k, v in cases.items()},
        "retrieve_bytes_per_hit": moved / rounds,
        "retrieve_bytes_per_hit_token": moved / max(1, sum(r["cached"] for r in cases["hit"])),
    }


def _show(rep: dict[str, Any]) -> None:
    t, c = rep["ttft_s"], rep["cached_tokens"]
    rows = [
        ("no connector", "none"),
        ("vLLM prefix caching on: miss", "vllm_miss"),
        ("vLLM prefix-cache hit", "vllm_hit"),
        ("kvwarden miss (fresh server)", "miss"),
        ("kvwarden repeat (at once)", "repeat"),
        ("kvwarden hit (another engine)", "hit"),
    ]
    print(
        f"vLLM time to first token, {rep['params']['prompt_tokens']}-token prompt, medians of "
        f"{rep['params']['rounds']}:"
    )
    for label, key in rows:
        print(f"  {label:32s} {1000 * t[key]:9.1f} ms   cached {c[key]:.0f}   runs {rep['runs'][key]}")
    print(f"  kvwarden hit / vLLM hit  {rep['hit_vs_vllm_hit']:.2f}x (target <= 1.1x)")
    print(f"  kvwarden repeat / vLLM hit  {rep['repeat_vs_vllm_hit']:.2f}x (target <= 1.2x)")
    print(f"  kvwarden miss / none     {rep['miss_vs_none']:.3f}x (target <= 1.03x)")
    print(
        f"  bytes a hit moves: {rep['retrieve_bytes_per_hit']:,.0f} "
        f"({rep['retrieve_bytes_per_hit_token']:,.0f} a token; {rep['params']['model_kind']} model)"
    )
    mla = " (MLA: a hit and a full prefill may round apart)" if rep["params"]["model_kind"] == "mla" else ""
    print(f"  hit and miss outputs equal: {rep['same_output']}{mla}", flush=True)
