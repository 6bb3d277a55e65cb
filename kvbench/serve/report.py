"""What `kvwarden bench serve` reports: each run summed up, the targets, a table and a plot."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from kvbench.serve.client import Stream
from kvbench.serve.stack import BY_KEY

# (configuration, the ideal's multiple its query-round mean TTFT must stay under)
TTFT_TARGETS = {"l1": 1.3, "fs": 1.6, "redis": 1.6}
GAP_TARGET = 1.5  # the Redis row's longest decode gap while a hit loads, against the ideal's
MISS_TARGET = 1.03  # a kvwarden row's warm-up (every request a miss) against vLLM alone


def ttfts(streams: list[Stream]) -> dict[str, Any]:
    ok = [s.ttft for s in streams if not s.error]
    if not ok:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "n": 0}
    return {
        "mean": float(np.mean(ok)),
        "p50": float(np.percentile(ok, 50)),
        "p90": float(np.percentile(ok, 90)),
        "n": len(ok),
        "runs": [round(x, 4) for x in ok],
    }


def _gap(streams: list[Stream]) -> float:
    gaps = [max(g) for s in streams if not s.error and (g := s.gaps())]
    return max(gaps) if gaps else math.nan


def _cached(streams: list[Stream]) -> float | None:
    got = [s.cached_tokens for s in streams if s.cached_tokens is not None]
    return float(np.median(got)) if got else None


def summarize_docqa(run: dict[str, Any]) -> dict[str, Any]:
    warm, query = run["warmup"]["streams"], run["query"]["streams"]
    return {
        "warmup_ttft": ttfts(warm),
        "query_ttft": ttfts(query),
        "round_s": run["query"]["round_s"],
        "warmup_round_s": run["warmup"]["round_s"],
        "max_gap_s": _gap(query),
        "cached_tokens": _cached(query),
        "probe": run["probe"],
        "errors": [s.error for s in warm + query if s.error][:5],
    }


def summarize_chat(run: dict[str, Any]) -> dict[str, Any]:
    first, later = run["first"], run["later"]
    return {
        "first_ttft": ttfts(first),
        "later_ttft": ttfts(later),
        "round_s": run["round_s"],
        "max_gap_s": _gap(first + later),
        "cached_tokens": _cached(later),
        "errors": [s.error for s in first + later if s.error][:5],
    }


def targets(rep: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target the runs can judge: what it compares, the ratio, the bound, and whether it held."""
    out: list[dict[str, Any]] = []
    doc = rep.get("docqa", {})
    ideal = doc.get("ideal")
    alone = doc.get("vllm")
    for key, bound in TTFT_TARGETS.items():
        if ideal and key in doc:
            r = doc[key]["query_ttft"]["mean"] / ideal["query_ttft"]["mean"]
            out.append(_target(f"query-round mean TTFT, {key} / ideal", r, bound))
    if ideal and "redis" in doc:
        a, b = doc["redis"]["probe"].get("max_gap_s"), ideal["probe"].get("max_gap_s")
        if a is not None and b:
            out.append(_target("longest decode gap while a hit loads, redis / ideal", a / b, GAP_TARGET))
    if alone:
        for key in TTFT_TARGETS:
            if key in doc:
                r = doc[key]["warmup_ttft"]["mean"] / alone["warmup_ttft"]["mean"]
                out.append(_target(f"miss (warm-up round) mean TTFT, {key} / vLLM alone", r, MISS_TARGET))
    return out


def _target(what: str, ratio: float, bound: float) -> dict[str, Any]:
    return {"what": what, "ratio": ratio, "bound": bound, "met": bool(ratio <= bound)}


def show(rep: dict[str, Any]) -> None:
    p = rep["params"]
    if "docqa" in rep:
        d = p["docqa"]
        print(
            f"\nLong-document QA: {d['docs']} documents of {d['doc_tokens']} tokens, query round "
            f"x{d['repeat']} tiled, {d['output_tokens']} output tokens, {d['inflight']} in flight "
            "(each row a just-started vLLM server, and kvwarden server where it has one)"
        )
        print(
            f"  {'configuration':52s} {'mean TTFT':>9s} {'p50':>7s} {'p90':>7s} {'round':>7s} "
            f"{'cached':>6s} {'miss TTFT':>9s} {'probe gap':>9s}"
        )
        for key, r in rep["docqa"].items():
            q, w, probe = r["query_ttft"], r["warmup_ttft"], r["probe"]
            cached = "-" if r["cached_tokens"] is None else f"{r['cached_tokens']:.0f}"
            gap = probe.get("max_gap_s")
            print(
                f"  {BY_KEY[key].label:52s} {q['mean']:8.3f}s {q['p50']:6.3f}s {q['p90']:6.3f}s "
                f"{r['round_s']:6.2f}s {cached:>6s} {w['mean']:8.3f}s "
                f"{'-' if gap is None else f'{gap:.3f}s':>9s}"
                + (f"  errors: {r['errors']}" if r["errors"] else "")
            )
    if "chat" in rep:
        c = p["chat"]
        print(
            f"\nMulti-round chat: {c['users']} users x {c['turns']} turns, {c['context_tokens']}-token "
            f"context after a {c['system_tokens']}-token system prompt, {c['question_tokens']}-token "
            f"questions, {c['output_tokens']} output tokens, think time {c['think_s']} s (mean)"
        )
        print(
            f"  {'configuration':52s} {'follow-up TTFT':>14s} {'p50':>7s} {'p90':>7s} {'1st turn':>8s} "
            f"{'round':>7s} {'max gap':>7s}"
        )
        for key, r in rep["chat"].items():
            lt, ft = r["later_ttft"], r["first_ttft"]
            print(
                f"  {BY_KEY[key].label:52s} {lt['mean']:13.3f}s {lt['p50']:6.3f}s {lt['p90']:6.3f}s "
                f"{ft['mean']:7.3f}s {r['round_s']:6.2f}s {r['max_gap_s']:6.3f}s"
                + (f"  errors: {r['errors']}" if r["errors"] else "")
            )
    if p.get("kvwarden_flags"):
        print(f"  (kvwarden rows off the defaults: {p['kvwarden_flags']})")
    if rep["targets"]:
        off = p.get("kvwarden_flags")
        print(
            f"\nTargets (a just-started server, {'OFF the defaults: ' + off if off else 'default settings'}):"
        )
        for t in rep["targets"]:
            mark = "met" if t["met"] else "NOT met"
            print(f"  {t['what']:60s} {t['ratio']:6.2f}x (<= {t['bound']}x) {mark}")
    if rep.get("plot"):
        print(f"\nplot: {rep['plot']}")


def plot(rep: dict[str, Any], out: Path) -> Path | None:
    """Bars of mean TTFT (with p90 marks) per configuration, one panel per protocol; None
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = [
        (name, field, title)
        for name, field, title in (
            ("docqa", "query_ttft", "long-document QA: query round"),
            ("chat", "later_ttft", "multi-round chat: follow-up turns"),
        )
        if rep.get(name)
    ]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    for ax, (name, field, title) in zip(axes[0], panels, strict=True):
        rows = rep[name]
        labels = [k for k in rows]
        means = [rows[k][field]["mean"] for k in labels]
        p90 = [rows[k][field]["p90"] for k in labels]
        xs = np.arange(len(labels))
        ax.bar(xs, means, color=["#888888" if k in ("ideal", "vllm") else "#3b7dd8" for k in labels])
        ax.scatter(xs, p90, marker="_", s=400, color="black", label="p90")
        ax.set_xticks(xs, labels)
        ax.set_ylabel("time to first token (s)")
        ax.set_title(title)
        ax.legend()
    fig.suptitle("kvwarden bench serve: vLLM's OpenAI server, just started (mean; p90 marked)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
