"""How many bits a quantized KV prefix needs for greedy outputs to stay identical.

    python scripts/quant_bits.py MODEL_DIR [--prompts 50] [--bits 8,9,10,12]

MODEL_DIR: SmolLM2-135M-Instruct as `kvbench.smollm2.build_smollm2` builds it (`kvwarden bench
quality` builds it too), with its ``texts.json``. Run with the Python of vLLM's environment
(transformers). For each prompt as `kvwarden bench quality` makes them (its first 512 tokens the
prefix, 16 more computed, then 32 greedy tokens), the prefix's KV is computed once in bfloat16,
then generation goes on from it exact and from it quantized as kvwarden's int8 chunks are (keys
per channel over each 256-token chunk, values per token over its heads and channels,
asymmetric, round to nearest) with ``b`` bits instead of 8. The same computation follows
either way, so only the quantization moves the outputs: the share identical over 32 tokens is
what an int8 hit can reach at best, and what each further bit buys.
"""

from __future__ import annotations

import argparse
from pathlib import Path

PREFIX, ASK, GEN, CHUNK = 512, 16, 32, 256


def quantize(x, dims, bits):  # type: ignore[no-untyped-def]
    """``x`` (float32) rounded to ``2**bits`` levels over its groups (the ``dims`` reduced)."""
    lo, hi = x.amin(dim=dims, keepdim=True), x.amax(dim=dims, keepdim=True)
    step = (hi - lo).clamp_min(1e-30) / (2**bits - 1)
    return ((x - lo) / step).round() * step + lo


def quantized_cache(cache, bits):  # type: ignore[no-untyped-def]
    import copy

    out = copy.deepcopy(cache)
    for layer in out.layers:
        k, v = layer.keys.float(), layer.values.float()  # [batch, heads, tokens, dim]
        b, h, t, d = k.shape
        kc = k.view(b, h, t // CHUNK, CHUNK, d)
        k = quantize(kc, (3,), bits).view(b, h, t, d)  # per channel, over a chunk's tokens
        v = quantize(v, (1, 3), bits)  # per token, over its heads and channels
        layer.keys.copy_(k.to(layer.keys.dtype))
        layer.values.copy_(v.to(layer.values.dtype))
    return out


def changed(a, b) -> float:  # type: ignore[no-untyped-def]
    """The share of elements that differ between two caches."""
    n = d = 0
    for x, y in zip(a.layers, b.layers, strict=True):
        for s, t in ((x.keys, y.keys), (x.values, y.values)):
            d += int((s != t).sum())
            n += s.numel()
    return d / n


def greedy(model, cache, ids):  # type: ignore[no-untyped-def]
    import torch

    out = []
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        for _ in range(GEN):
            nxt = int(logits[0, -1].argmax())
            out.append(nxt)
            logits = model(input_ids=torch.tensor([[nxt]]), past_key_values=cache, use_cache=True).logits
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--bits", default="0,8,10,12,16", help="0: the exact prefix again (the harness's check)")
    ns = ap.parse_args()
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(ns.model, dtype=torch.bfloat16).eval()
    from kvbench.quality import windows

    prompts = windows(Path(ns.model), ns.prompts)  # (the prompts `kvwarden bench quality` takes)
    bits = [int(b) for b in ns.bits.split(",")]
    same = {b: 0 for b in bits}
    alike = {b: 0 for b in bits}
    moved = {b: 0.0 for b in bits}  # the share of the prefix's KV elements quantizing changed
    for p in prompts:
        with torch.no_grad():
            pre = model(input_ids=torch.tensor([p[:PREFIX]]), use_cache=True).past_key_values
        ask = torch.tensor([p[PREFIX : PREFIX + ASK]])
        ref = greedy(model, copy.deepcopy(pre), ask)
        for b in bits:
            q = quantized_cache(pre, b) if b else copy.deepcopy(pre)
            moved[b] += changed(pre, q) / len(prompts)
            got = greedy(model, q, ask)
            same[b] += got == ref
            alike[b] += next((i for i, (x, y) in enumerate(zip(got, ref, strict=True)) if x != y), GEN)
    n = len(prompts)
    for b in bits:
        print(
            f"{b:2d} bits: {same[b] / n:.0%} of {n} outputs identical over {GEN} tokens, "
            f"{alike[b] / n:.1f} tokens alike, {moved[b]:.2%} of the prefix's KV elements changed"
        )


if __name__ == "__main__":
    main()
