"""One streamed completion from vLLM's OpenAI server, timed token by token.

``stream`` posts ``/v1/completions`` with ``stream: true`` and notes when each server-sent event
that carries text arrives: the first is the time to first token, the gaps between the others
the inter-token gaps a user sees. Greedy, ``ignore_eos`` (a random-weight model would stop at any
time), and the usage of the request (its cached prompt tokens, when the server reports them).
Standard library only: the benchmark runs beside the server, not inside its environment.
"""

from __future__ import annotations

import http.client
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


@dataclass
class Stream:
    """What one request saw: ``sent`` is the perf_counter time it was sent, ``times`` those of
    its tokens' events, ``text`` the text they carried."""

    sent: float
    times: list[float] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.times[0] - self.sent if self.times else float("nan")

    @property
    def done(self) -> float:
        return self.times[-1] if self.times else self.sent

    def gaps(self) -> list[float]:
        """The gaps between successive tokens."""
        return [g for _, _, g in self.timed_gaps()]

    def timed_gaps(self) -> list[tuple[float, float, float]]:
        """(earlier token's time, later token's time, gap) of each pair of successive tokens."""
        return [(a, b, b - a) for a, b in itertools.pairwise(self.times)]


def stream(
    base_url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    timeout_s: float = 600.0,
    on_token: Callable[[Stream], None] | None = None,
) -> Stream:
    """One completion of ``prompt``; a failure is kept in ``error`` (never raised).
    ``on_token`` is called with the stream after each event that carried text."""
    url = urlsplit(base_url)
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80, timeout=timeout_s)
    out = Stream(sent=time.perf_counter())
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {resp.read()[:300]!r}"
            return out
        while True:
            line = resp.readline()
            if not line:
                break
            now = time.perf_counter()
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            if _event(out, json.loads(data), now) and on_token is not None:
                on_token(out)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    if out.error is None and len(out.times) < 1:
        out.error = "no token came back"
    return out


def _event(out: Stream, event: dict[str, Any], now: float) -> bool:
    """Notes one event; True when it carried text."""
    got = False
    for choice in event.get("choices") or ():
        text = choice.get("text") or ""
        if text:
            out.times.append(now)
            out.text += text
            got = True
    usage = event.get("usage")
    if usage:
        out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            out.cached_tokens = int(details["cached_tokens"])
    return got
