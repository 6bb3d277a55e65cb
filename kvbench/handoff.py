"""`kvwarden bench handoff`: a disaggregated prefill's decode, timed against vLLM's own prefix hit.

The model and prompts of `kvwarden bench vllm` (a random-weight Llama where prefill dominates,
~2,900-token prompts, one output token: a request's time is its time to first token), engines
one after another on the same cores, each prompt new to every cache:
- **vLLM prefix hit**: an engine without kvwarden, its own prefix caching on, a prompt it has
  just served (the floor for any hit; its first pass is the single-engine run);
- **prefill**: a ``kv_producer`` engine with kvwarden (its own prefix caching off), each prompt
  once, on a server just started: it stores the prompt before it answers, and answers the
  ``kv_transfer_params`` naming what it stored;
- **decode**: a ``kv_consumer`` engine, each prompt with the prefill's params (what
  ``kvwarden proxy`` sends it): its time to first token after the prefill returned, and the
  prompt tokens it computed (those past the last full chunk);
- **prefill, tail** and **decode, tail**: the same with a producer that stores each prompt's
  tail too (``kvwarden.store_tail``), on prompts of their own: the decode computes the prompt's
  last token alone.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from kvbench.procs import launch, wait_http
from kvbench.results import add_output_args, finish
from kvbench.vllm import CHUNK, EngineProcess, _prompts, build_in, engine_python


def add_args(sub: Any) -> None:
    p = sub.add_parser(
        "handoff", help="prefill/decode handoff: the decode's time to first token vs vLLM's own hit"
    )
    p.add_argument("--rounds", type=int, default=None, help="prompts (5; quick 2)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="default 2900")
    p.add_argument("--vllm-python", default=None, help="the Python of vLLM's environment (.venv-vllm)")
    p.add_argument(
        "--reserved-cpus", type=int, default=1, help="VLLM_CPU_NUM_OF_RESERVED_CPU of every engine"
    )
    add_output_args(p)
    p.set_defaults(func=run_handoff)


def run_handoff(ns: argparse.Namespace) -> int:
    python = engine_python(ns)
    if python is None:
        return 2
    from kvbench.vllm_model import PREFILL, TINY

    shape = TINY if ns.tiny else PREFILL
    with tempfile.TemporaryDirectory(prefix="kvwarden-bench-handoff-") as tmp:
        work = Path(tmp)
        model = work / "model"
        build_in(python, model, f"build_model({{path!r}}, {shape!r})")
        env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(ns.reserved_cpus)}
        out = _measure(python, model, work, ns.rounds, ns.prompt_tokens, env)
    out["params"] = {
        "rounds": ns.rounds,
        "prompt_tokens": ns.prompt_tokens,
        "model": str(shape),
        "reserved_cpus": ns.reserved_cpus,
    }
    finish(ns, "handoff", out, _show)
    return 0


def _measure(
    python: str, model: Path, work: Path, rounds: int, tokens: int, env: dict[str, str]
) -> dict[str, Any]:
    prompts, tailed = _prompts(3, rounds, tokens), _prompts(4, rounds, tokens)
    names = ("vllm_miss", "vllm_hit", "prefill", "decode", "vllm_miss_tail", "prefill_tail", "decode_tail")
    cases: dict[str, list[dict[str, Any]]] = {k: [] for k in names}
    own = EngineProcess(python, model, None, work / "own.log", prefix_caching=True, env_extra=env)
    try:
        for p in prompts:
            cases["vllm_miss"].append(own.generate(p, 1))
            cases["vllm_hit"].append(own.generate(p, 1))
        for p in tailed:
            cases["vllm_miss_tail"].append(own.generate(p, 1))  # (the single-engine outputs)
    finally:
        own.close()
    srv = launch("--chunk-size", str(CHUNK), "--l1-size-gb", "2")
    try:
        wait_http(srv)
        roles = {**env, "KVWARDEN_ENGINE_ROLE": "kv_producer"}
        for case, ps, extra in (
            ("prefill", prompts, {}),
            ("prefill_tail", tailed, {"kvwarden.store_tail": True}),
        ):
            prefill = EngineProcess(python, model, srv.endpoint, work / f"{case}.log", extra, env_extra=roles)
            try:
                cases[case] += [prefill.generate(p, 1) for p in ps]
            finally:
                prefill.close()
        roles["KVWARDEN_ENGINE_ROLE"] = "kv_consumer"
        decode = EngineProcess(python, model, srv.endpoint, work / "decode.log", env_extra=roles)
        try:
            for case, ps in (("decode", prompts), ("decode_tail", tailed)):
                for p, pre in zip(ps, cases[case.replace("decode", "prefill")], strict=True):
                    cases[case].append(decode.generate(p, 1, kv_transfer_params=pre["kv_transfer_params"]))
        finally:
            decode.close()
    finally:
        srv.proc.terminate()
        srv.proc.wait(30)
    return _report(cases, tokens)


def _report(cases: dict[str, list[dict[str, Any]]], tokens: int) -> dict[str, Any]:
    """Each case's medians and runs, the ratios to vLLM's own hit, the tokens each decode
    computed, and whether the decodes answered what the single engine did."""
    med = {k: statistics.median(r["s"] for r in v) for k, v in cases.items()}
    return {
        "ttft_s": med,
        "cached_tokens": {k: statistics.median(r["cached"] for r in v) for k, v in cases.items()},
        "decode_computed_tokens": [tokens - r["cached"] for r in cases["decode"]],
        "decode_tail_computed_tokens": [tokens - r["cached"] for r in cases["decode_tail"]],
        "decode_vs_vllm_hit": med["decode"] / med["vllm_hit"],
        "decode_tail_vs_vllm_hit": med["decode_tail"] / med["vllm_hit"],
        "handed_params": all(r["kv_transfer_params"] for r in cases["prefill"] + cases["prefill_tail"]),
        "same_output": all(
            a["tokens"] == b["tokens"] for a, b in zip(cases["vllm_miss"], cases["decode"], strict=True)
        ),
        "same_output_tail": all(
            a["tokens"] == b["tokens"]
            for a, b in zip(cases["vllm_miss_tail"], cases["decode_tail"], strict=True)
        ),
        "runs": {k: [round(r["s"], 4) for r in v] for k, v in cases.items()},
    }


def _show(rep: dict[str, Any]) -> None:
    t, c = rep["ttft_s"], rep["cached_tokens"]
    print(
        f"prefill/decode handoff, {rep['params']['prompt_tokens']}-token prompt, medians of "
        f"{rep['params']['rounds']}:"
    )
    for label, key in (
        ("vLLM prefix caching on: miss", "vllm_miss"),
        ("vLLM prefix-cache hit", "vllm_hit"),
        ("prefill (kv_producer)", "prefill"),
        ("decode (kv_consumer, handed off)", "decode"),
        ("prefill, storing the tail", "prefill_tail"),
        ("decode, handed the tail", "decode_tail"),
    ):
        print(f"  {label:34s} {1000 * t[key]:9.1f} ms   cached {c[key]:.0f}   runs {rep['runs'][key]}")
    print(f"  decode / vLLM hit  {rep['decode_vs_vllm_hit']:.2f}x (target <= 1.2x)")
    print(f"  decode, handed the tail / vLLM hit  {rep['decode_tail_vs_vllm_hit']:.2f}x")
    print(f"  prompt tokens the decode computed: {rep['decode_computed_tokens']}")
    print(f"  prompt tokens the decode computed, handed the tail: {rep['decode_tail_computed_tokens']}")
    print(
        f"  params handed: {rep['handed_params']}; decode output = single-engine run: {rep['same_output']}, "
        f"handed the tail: {rep['same_output_tail']}"
    )
