"""A Llama with random weights, built on this machine (no download), for vLLM runs.

``build_model(path, shape)`` saves a ``transformers`` Llama whose weights come from a fixed seed,
so every process that builds the same shape gets the same model. Prompts are token ids
(engines run with ``skip_tokenizer_init``), so no tokenizer is needed. ``write_lora(path, shape,
seed)`` saves a LoRA adapter for such a model in PEFT's format (``adapter_config.json`` and
``adapter_model.safetensors``), random too: it adapts ``k_proj`` and ``v_proj`` only, so what it
changes is the KV a prompt leaves, and through it the output. Needs ``transformers`` (installed
with vLLM: the ``vllm`` extra of kvwarden-server).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


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
# `bench serve`'s model, served in float32: 32 KiB of KV a token (8 layers x 4 heads x 128 x K
# and V x 4 bytes) with a fraction of PREFILL's compute, so a serving run of hundreds of
# 3,000-token prompts fits in minutes on 2 cores
SERVE = ModelShape(hidden=256, layers=8, heads=4, kv_heads=4, head_dim=128, intermediate=512)


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


@dataclass(frozen=True)
class MLAShape:
    """A DeepSeek-V2 with multi-head latent attention, its MLP dense in every layer: each
    token caches one latent of ``kv_lora_rank + rope_dim`` (576 in DeepSeek's models, the only
    width vLLM's CPU MLA kernel takes)."""

    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_lora_rank: int = 512
    rope_dim: int = 64
    nope_dim: int = 64
    v_dim: int = 64
    vocab: int = 1024
    # wider than the usual 0.02: a random MLA model's greedy output then varies with the
    # prompt and its top token leads by a margin, rather than repeating one token on a flat
    # distribution where any rounding flips it
    init_std: float = 0.2
    max_positions: int = 4096


MLA = MLAShape()


def build_mla_model(path: str | Path, shape: MLAShape = MLA, seed: int = 1234) -> Path:
    """Save a random DeepSeek-V2 (MLA) model under ``path`` (kept when the same shape is there)."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    out = Path(path)
    stamp = out / "kvwarden-shape.json"
    want = json.dumps({"mla": asdict(shape), "seed": seed}, sort_keys=True)
    if stamp.exists() and stamp.read_text() == want:
        return out
    cfg = DeepseekV2Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=2 * shape.hidden,
        moe_intermediate_size=shape.hidden // 2,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        kv_lora_rank=shape.kv_lora_rank,
        q_lora_rank=None,
        qk_rope_head_dim=shape.rope_dim,
        qk_nope_head_dim=shape.nope_dim,
        v_head_dim=shape.v_dim,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=shape.layers,  # no MoE layer: dense MLPs only
        initializer_range=shape.init_std,
        max_position_embeddings=shape.max_positions,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(cfg).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(want)
    return out


def build_sliding_window_model(path: str | Path, window: int = 256, seed: int = 1234) -> Path:
    """Save a random Mistral whose every layer attends to a sliding window of ``window`` tokens
    (TINY's sizes) under ``path`` (kept when already there)."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    out = Path(path)
    stamp = out / "kvwarden-shape.json"
    want = json.dumps({"sliding_window": window, **asdict(TINY), "seed": seed}, sort_keys=True)
    if stamp.exists() and stamp.read_text() == want:
        return out
    cfg = MistralConfig(
        vocab_size=TINY.vocab,
        hidden_size=TINY.hidden,
        intermediate_size=2 * TINY.hidden,
        num_hidden_layers=TINY.layers,
        num_attention_heads=TINY.heads,
        num_key_value_heads=TINY.kv_heads,
        head_dim=TINY.head_dim,
        sliding_window=window,
        max_position_embeddings=TINY.max_positions,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = MistralForCausalLM(cfg).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(want)
    return out


def build_hybrid_model(path: str | Path, kind: str, seed: int = 1234) -> Path:
    """Save a random hybrid of TINY's sizes and 4 layers under ``path`` (kept when already
    there): ``kind`` "gemma3", three sliding-window layers (a 256-token window) and one of full
    attention; "granite4", three Mamba-2 layers and one of attention (Granite 4's kind)."""
    import torch
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        GraniteMoeHybridConfig,
        GraniteMoeHybridForCausalLM,
    )

    out = Path(path)
    stamp = out / "kvwarden-shape.json"
    want = json.dumps({"hybrid": kind, **asdict(TINY), "seed": seed}, sort_keys=True)
    if stamp.exists() and stamp.read_text() == want:
        return out
    common = dict(
        vocab_size=TINY.vocab,
        hidden_size=TINY.hidden,
        intermediate_size=2 * TINY.hidden,
        num_hidden_layers=4,
        num_attention_heads=TINY.heads,
        num_key_value_heads=TINY.kv_heads,
        max_position_embeddings=TINY.max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="bfloat16",
    )
    model: Any
    torch.manual_seed(seed)
    if kind == "gemma3":
        layers = ["sliding_attention"] * 3 + ["full_attention"]
        cfg: Any = Gemma3TextConfig(head_dim=TINY.head_dim, sliding_window=256, layer_types=layers, **common)
        model = Gemma3ForCausalLM(cfg)
    elif kind == "granite4":
        cfg = GraniteMoeHybridConfig(
            shared_intermediate_size=2 * TINY.hidden,
            layer_types=["mamba"] * 3 + ["attention"],
            num_local_experts=0,
            mamba_n_heads=8,
            mamba_d_head=64,
            mamba_n_groups=1,
            mamba_d_state=64,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=256,
            position_embedding_type="rope",
            **common,
        )
        model = GraniteMoeHybridForCausalLM(cfg)
    else:
        raise ValueError(f"hybrid kind {kind!r}: gemma3 or granite4")
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    stamp.write_text(want)
    return out


LORA_RANK = 8  # an engine that serves these adapters needs max_lora_rank >= this
LORA_TARGETS = ("k_proj", "v_proj")


def write_lora(
    path: str | Path, shape: ModelShape, seed: int, rank: int = LORA_RANK, std: float = 0.05
) -> Path:
    """Save a random LoRA adapter for a model of ``shape`` under ``path``: the same ``seed`` gives
    the same weights. Both ``lora_A`` and ``lora_B`` are random (a freshly initialized adapter's
    ``lora_B`` is zero: it would change nothing), of std ``std``; alpha is twice the rank, so with
    the default std the adapted projections' weights move by about 0.7 times the spread of the
    base model's own (std 0.02): enough to change a prompt's greedy output, not so much that it
    repeats one token."""
    import torch
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    kv_out = shape.kv_heads * shape.head_dim
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(shape.layers):
        for name in LORA_TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, shape.hidden, generator=gen) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(kv_out, rank, generator=gen) * std
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, out / "adapter_model.safetensors"
    )
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(LORA_TARGETS),
        "bias": "none",
        "base_model_name_or_path": None,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def build_tokenizer(path: str | Path, vocab: int) -> Path:
    """Save a tokenizer for a model of ``vocab`` tokens under ``path``: one word a token
    (``w<id>`` for ids 3 and up; 0, 1 and 2 are ``<unk>``, ``<s>`` and ``</s>``), split on
    whitespace, so a prompt of such words is exactly those token ids and an output decodes to
    words that tokenize back to it. Lets vLLM's OpenAI server take text with no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # words joined by one space
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", model_max_length=1 << 20
    )
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return out
