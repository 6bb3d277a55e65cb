"""The two workloads `kvwarden bench serve` sends to vLLM's OpenAI server.

- **Long-document QA** (LMCache's ``benchmarks/long-doc-qa``): a warm-up round sends each
  document once (every request a miss); the query round sends them ``repeat`` times more in tiled
  order (0..n-1, 0..n-1), ``inflight`` requests at a time. Each prompt is a document followed by
  the same question. Then decode probes, ``probes`` of them, one after another: a stream
  decodes a short new prompt, and once it has produced ``PROBE_LEAD`` tokens a document (the
  first, then the second, ...) is asked again (in the configurations with a small engine cache,
  its KV is then in a slower tier); the stream's longest gap between two tokens from that
  moment until the document's first token (and one gap after) is what a user already reading
  an answer sees while another request loads. The probes' median is reported: one probe is one
  sample of a noisy machine. A probe that measured no gap (its stream reached the client all at
  once, before the document was answered) is made again with a document not yet probed.
- **Multi-round chat**: ``users`` users at once, each with its own context after a shared system
  prompt; every turn resends the conversation so far (the previous answers included) with a new
  question, after a think time (exponential, seeded: the same in every configuration).

Prompts are words of the benchmark's tokenizer (``w<id>``, one token each), random from a
fixed seed, so every configuration sees the same requests.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbench.serve.client import Stream, stream

PROBE_LEAD = 8  # tokens the probe has decoded before the document is sent
PROBE_TRIES = 3  # a probe that measured no gap is made again, this many times in all
FIRST_WORD = 3  # ids 0-2 are the tokenizer's special tokens


def words(rng: np.random.Generator, n: int, vocab: int) -> str:
    return " ".join(f"w{int(i)}" for i in rng.integers(FIRST_WORD, vocab, n))


@dataclass(frozen=True)
class DocQA:
    docs: int = 16
    doc_tokens: int = 3000
    question_tokens: int = 32
    output_tokens: int = 16
    inflight: int = 4
    repeat: int = 2
    probes: int = 5
    probe_tokens: int = 96
    vocab: int = 1024
    seed: int = 7

    def prompts(self) -> list[str]:
        rng = np.random.default_rng(self.seed)
        question = words(rng, self.question_tokens, self.vocab)
        return [words(rng, self.doc_tokens, self.vocab) + " " + question for _ in range(self.docs)]

    def tokens(self) -> int:
        """Tokens of every prompt together (what an engine cache needs room for)."""
        return self.docs * (self.doc_tokens + self.question_tokens)

    def run(self, url: str, model: str) -> dict[str, Any]:
        prompts = self.prompts()
        warm = _round(url, model, prompts, self.output_tokens, self.inflight)
        order = [prompts[i] for _ in range(self.repeat) for i in range(self.docs)]
        query = _round(url, model, order, self.output_tokens, self.inflight)
        probes = [self._probe_until_measured(url, model, prompts, i) for i in range(self.probes)]
        return {"warmup": warm, "query": query, "probe": _median_probe(probes)}

    def _probe_until_measured(self, url: str, model: str, prompts: list[str], i: int) -> dict[str, Any]:
        """Probe ``i`` (document i), made again with the next documents not yet probed (at most
        `PROBE_TRIES` times in all) while it measured no gap: the stream's tokens all reached
        the client before the document was sent or answered (a client that got no CPU for a
        while reads them in one burst). ``tries`` says how many it took."""
        for attempt in range(PROBE_TRIES):
            doc = prompts[(i + attempt * self.probes) % len(prompts)]
            got = self._probe(url, model, doc, i)
            got["tries"] = attempt + 1
            if "error" in got or not math.isnan(got["max_gap_s"]):
                break
        return got

    def _probe(self, url: str, model: str, doc: str, i: int) -> dict[str, Any]:
        rng = np.random.default_rng(self.seed + 1 + i)
        short = words(rng, 64, self.vocab)
        decoding_now = threading.Event()

        def lead(s: Stream) -> None:
            if len(s.times) >= PROBE_LEAD:
                decoding_now.set()

        with ThreadPoolExecutor(1, thread_name_prefix="bench-probe") as pool:
            future = pool.submit(stream, url, model, short, self.probe_tokens, 600.0, lead)
            decoding_now.wait(300)  # (or the probe failed: its error is reported below)
            hit = stream(url, model, doc, self.output_tokens)
            s = future.result()
        if s.error or hit.error or not decoding_now.is_set():
            return {"error": s.error or hit.error or "the probe ended before the document was sent"}
        gaps = s.timed_gaps()
        window = [g for a, b, g in gaps if b > hit.sent and a <= hit.times[0]]
        before = [g for a, b, g in gaps if b <= hit.sent]
        return {
            "max_gap_s": max(window) if window else float("nan"),
            "steady_gap_s": float(np.median(before)) if before else float("nan"),
            "hit_ttft_s": hit.ttft,
            "hit_cached_tokens": hit.cached_tokens,
        }


def _median_probe(probes: list[dict[str, Any]]) -> dict[str, Any]:
    """The probes' medians (max_gap_s, steady_gap_s, hit_ttft_s, hit_cached_tokens) over the
    probes that have the figure (a probe whose stream ended before the document was answered
    has no gap), and each probe under ``each``; the first error when one failed."""
    failed = [p["error"] for p in probes if "error" in p]
    if failed:
        return {"error": failed[0], "each": probes}
    out: dict[str, Any] = {}
    for k in ("max_gap_s", "steady_gap_s", "hit_ttft_s", "hit_cached_tokens"):
        got = [float(p[k]) for p in probes if p[k] is not None and not math.isnan(p[k])]
        out[k] = float(np.median(got)) if got else float("nan")
    out["each"] = probes
    return out


@dataclass(frozen=True)
class Chat:
    users: int = 12
    turns: int = 4
    system_tokens: int = 256
    context_tokens: int = 1536
    question_tokens: int = 64
    output_tokens: int = 32
    think_s: float = 1.0
    vocab: int = 1024
    seed: int = 11

    def tokens(self) -> int:
        per_user = self.context_tokens + self.turns * (self.question_tokens + self.output_tokens)
        return self.system_tokens + self.users * per_user

    def run(self, url: str, model: str) -> dict[str, Any]:
        rng = np.random.default_rng(self.seed)
        system = words(rng, self.system_tokens, self.vocab)
        plans = []
        for _ in range(self.users):
            context = words(rng, self.context_tokens, self.vocab)
            questions = [words(rng, self.question_tokens, self.vocab) for _ in range(self.turns)]
            thinks = [float(x) for x in rng.exponential(self.think_s, self.turns)]
            plans.append((system + " " + context, questions, thinks))
        results: list[list[Stream]] = [[] for _ in range(self.users)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(self.users, thread_name_prefix="bench-user") as pool:
            for u, plan in enumerate(plans):
                pool.submit(self._user, url, model, u, plan, results[u])
        first = [r[0] for r in results if r]
        later = [s for r in results for s in r[1:]]
        return {"first": first, "later": later, "round_s": time.perf_counter() - t0}

    def _user(
        self, url: str, model: str, u: int, plan: tuple[str, list[str], list[float]], out: list[Stream]
    ) -> None:
        conversation, questions, thinks = plan
        pause = threading.Event()
        pause.wait(0.25 * u)  # users arrive one after another
        for question, think in zip(questions, thinks, strict=True):
            conversation += " " + question
            s = stream(url, model, conversation, self.output_tokens)
            out.append(s)
            if s.error:
                return
            conversation += " " + s.text.strip()
            pause.wait(think)


def _round(url: str, model: str, prompts: list[str], output_tokens: int, inflight: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(inflight, thread_name_prefix="bench-request") as pool:
        streams = list(pool.map(lambda p: stream(url, model, p, output_tokens), prompts))
    return {"streams": streams, "round_s": time.perf_counter() - t0}
