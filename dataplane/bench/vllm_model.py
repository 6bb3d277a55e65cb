"""A Llama with random weights, built on this machine (no download), for vLLM runs.

``build_model(path, shape)`` saves a ``transformers`` Llama whose weights come from a fixed seed,
so every process that builds the same shape gets the same model. Prompts are token ids
(engines run with ``skip_tokenizer_init``), so no tokenizer is needed. Needs ``transformers``
(installed with vLLM: the ``vllm`` extra of kvwarden-server).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int = 1024
    intermediate: int = 0  # 0: 2 x hidden
    max_positions: int = 4096


# a model that builds in seconds: for correctness tests
TINY = ModelShape(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64)
# prefill dominates a ~2,900-token prompt (88 MiB of KV for 2,816 tokens in bf16)
PREFILL = ModelShape(hidden=1024, layers=8, heads=8, kv_heads=8, head_dim=128)


def build_model(path: str | Path, shape: ModelShape, seed: int = 1234) -> Path:
    """Save the model under ``path`` (kept when the same shape is already there)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(path)
    stamp = out / "kvwarden-shape.json"
    want = json.dumps({**asdict(shape), "seed": seed}, sort_keys=True)
    if stamp.exists() and stamp.read_text() == want:
        return out
    cfg = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate or 2 * shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_positions,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(want)
    return out
