"""`kvwarden bench serve`: vLLM's OpenAI server under load, with and without kvwarden.

Each configuration (`kvbench.serve.stack.CONFIGS`: vLLM's own prefix cache with room for
everything, the ideal; vLLM's own cache at 1 GiB alone; then with kvwarden, its hits in L1, in
the file tier, in Redis) is started fresh for each protocol (`kvbench.serve.protocols`:
long-document QA, multi-round chat), with default settings, and the protocol is sent at once:
what a user of a just-started server meets. The report gives the time to first token (mean, p50,
p90), the round time, and the longest gap between two tokens of a stream already decoding, as a
table, a plot and JSON; then the targets it can judge. The model is a random-weight Llama with
32 KiB of KV a token (`kvbench.vllm_model.SERVE`) and a tokenizer of its own, both built here,
served in float32 by default: vLLM's CPU build runs bfloat16 matrix products through torch's
own kernels where oneDNN has none for the CPU (no AVX-512 BF16), about 8x slower than float32
(``--dtype bfloat16`` to run it anyway).
LMCache's MP server is not one of the configurations: it is not installed with kvwarden, and
its rows in BENCHMARKS.md come from its own run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvbench.procs import bench_env
from kvbench.results import add_output_args, finish, resolve
from kvbench.serve import report
from kvbench.serve.protocols import Chat, DocQA
from kvbench.serve.stack import BY_KEY, CONFIGS, CPU_BLOCK, SERVED_NAME, Stack
from kvbench.vllm import default_python

PROTOCOLS = ("docqa", "chat")


def add_args(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="vLLM's OpenAI server under load (document QA, multi-round chat), with and without kvwarden",
    )
    p.add_argument(
        "--configs",
        default=",".join(c.key for c in CONFIGS),
        help=f"configurations to run, comma-separated, of {','.join(BY_KEY)}",
    )
    p.add_argument("--protocols", default=",".join(PROTOCOLS), help=f"of {','.join(PROTOCOLS)}")
    p.add_argument("--docs", type=int, default=None, help="documents (16; quick 8)")
    p.add_argument("--doc-tokens", type=int, default=None, help="tokens a document (3000)")
    p.add_argument("--users", type=int, default=None, help="chat users (12; quick 6)")
    p.add_argument("--turns", type=int, default=None, help="chat turns a user (4; quick 3)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the model's dtype in vLLM (float32)",
    )
    p.add_argument(
        "--kvwarden-flags",
        default="",
        help="more `kvwarden serve` flags for the kvwarden rows, as one string (a run off the defaults, "
        'e.g. "--chunk-size 128"; the report says so)',
    )
    p.add_argument("--vllm-python", default=None, help="the Python of vLLM's environment (.venv-vllm)")
    p.add_argument(
        "--reserved-cpus",
        type=int,
        default=1,
        help="cores vLLM keeps from its worker (VLLM_CPU_NUM_OF_RESERVED_CPU), the same for every row",
    )
    p.add_argument(
        "--plot", type=Path, default=None, help="where to write the plot (RESULTS_DIR/serve-<time>.png)"
    )
    add_output_args(p)
    p.set_defaults(func=run_serve)


def _parse(ns: argparse.Namespace) -> tuple[list[str], list[str]] | str:
    configs = [c.strip() for c in str(ns.configs).split(",") if c.strip()]
    protocols = [c.strip() for c in str(ns.protocols).split(",") if c.strip()]
    if not configs or set(configs) - set(BY_KEY):
        return f"--configs takes some of {','.join(BY_KEY)}"
    if not protocols or set(protocols) - set(PROTOCOLS):
        return f"--protocols takes some of {','.join(PROTOCOLS)}"
    if min(ns.docs, ns.users, ns.turns) < 1 or ns.doc_tokens < 256:
        return "--docs, --users and --turns must be at least 1, --doc-tokens at least 256"
    return configs, protocols


def _run_protocol(
    name: str, proto: DocQA | Chat, stacks: Mapping[str, Callable[[], Stack]]
) -> dict[str, Any]:
    """Each configuration's run of ``proto``, summed up, on a stack started for it alone."""
    rows: dict[str, Any] = {}
    for key, make in stacks.items():
        print(f"bench serve: {name}, {BY_KEY[key].label} ...", file=sys.stderr, flush=True)
        with make() as stack:
            raw = proto.run(stack.url, SERVED_NAME)
            summary = report.summarize_docqa(raw) if name == "docqa" else report.summarize_chat(raw)
            summary["started_s"] = stack.started_s
            summary["kv_gb"] = stack.kv_gb
            summary["kvwarden_metrics"] = stack.metrics()
        rows[key] = summary
    return rows


def _build_model(python: str, shape: Any, model: Path) -> Path:
    """The random-weight model and its tokenizer, built by vLLM's Python under ``model``."""
    code = (
        "from kvbench.vllm_model import *; "
        f"build_model({str(model)!r}, {shape!r}); build_tokenizer({str(model)!r}, {shape.vocab})"
    )
    subprocess.run([python, "-c", code], check=True, env=bench_env())
    return model


def run_serve(ns: argparse.Namespace) -> int:
    resolve(ns, docs=(16, 8, 2), doc_tokens=(3000, 3000, 600), users=(12, 6, 2), turns=(4, 3, 2))
    parsed = _parse(ns)
    if isinstance(parsed, str):
        print(f"bench serve: {parsed}", file=sys.stderr)
        return 2
    configs, protocols = parsed
    from kvbench.vllm_model import SERVE, TINY

    shape = TINY if ns.tiny else SERVE
    docqa = DocQA(docs=ns.docs, doc_tokens=ns.doc_tokens, vocab=shape.vocab)
    chat = Chat(users=ns.users, turns=ns.turns, vocab=shape.vocab)
    if ns.tiny:
        chat = dataclasses.replace(chat, context_tokens=256, think_s=0.1)
        docqa = dataclasses.replace(docqa, probe_tokens=200, probes=3)
    python = ns.vllm_python or default_python()
    blocks = -(-(docqa.doc_tokens + docqa.question_tokens) // CPU_BLOCK) + 3 if ns.tiny else None
    small_l1 = 0.001 if ns.tiny else None  # --tiny: engine cache and L1 hold about one document
    per_token = shape.layers * 2 * shape.kv_heads * shape.head_dim * (4 if ns.dtype == "float32" else 2)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvwarden-bench-serve-") as tmp:
        work = Path(tmp)
        model = _build_model(python, shape, work / "model")
        for name in protocols:
            proto = docqa if name == "docqa" else chat
            ideal_gb = math.ceil(proto.tokens() * per_token * 1.5 / (1 << 30)) + 1
            stacks = {
                key: functools.partial(
                    Stack,
                    BY_KEY[key],
                    python,
                    model,
                    work,
                    BY_KEY[key].kv_gb or ideal_gb,
                    ns.reserved_cpus,
                    ns.dtype,
                    blocks,
                    small_l1,
                    tuple(shlex.split(ns.kvwarden_flags)),
                )
                for key in configs
            }
            out[name] = _run_protocol(name, proto, stacks)
    out["params"] = {
        "model": str(shape),
        "dtype": ns.dtype,
        "kvwarden_flags": ns.kvwarden_flags,
        "kv_bytes_per_token": per_token,
        "reserved_cpus": ns.reserved_cpus,
        "docqa": dataclasses.asdict(docqa),
        "chat": dataclasses.asdict(chat),
    }
    out["targets"] = report.targets(out)
    plot_path = ns.plot
    if plot_path is None:
        plot_path = Path(ns.results_dir) / "serve-latest.png"
    drawn = report.plot(out, plot_path)
    out["plot"] = str(drawn) if drawn else None
    finish(ns, "serve", out, report.show)
    return 0
