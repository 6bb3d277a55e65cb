"""Which models and requests kvwarden caches, and how: the scope an engine's workers register, decided from
a plain description of the engine's model (`EngineModel`, which the connector reads off vLLM's
configuration), or why the engine runs without the cache (`Declined`).

- Dense attention (one KV cache group of full attention): K and V a token and head, format
  ``vllm_cpu`` on vLLM's CPU backend, ``token_major`` on CUDA.
- Multi-head latent attention (DeepSeek V2/V3, Kimi K2): one latent a token, format ``latent``,
  registered as one head of the latent's width; every tensor-parallel rank holds the same latent,
  so it is keyed once for all ranks and rank 0 stores it. vLLM's CPU backend only: its CUDA
  layout is not one kvwarden moves yet. Not with decode context parallelism (ranks then hold
  different tokens).
- Quantized KV (vLLM's ``kv_cache_dtype``): fp8 (``fp8`` and ``fp8_e4m3``, E4M3; ``fp8_e5m2``)
  is registered under its own dtype (``float8_e4m3fn``, ``float8_e5m2``), not as the bytes vLLM
  stores it in, so a bf16 engine never reads fp8 KV and E4M3 never serves E5M2; its per-layer
  scales are the checkpoint's (vLLM 0.32 computes none at run time), part of the model as its
  weights are. The kinds that keep scales beside the KV (per token and head) are declined.
- Sliding-window layers, with vLLM's hybrid KV cache manager on (Gemma 3, gpt-oss: groups of
  sliding-window layers beside groups of full attention; Mistral: every layer a sliding window):
  each KV cache group is a scope of its own (its layers; the served name with ``#g<i>`` when the
  model has several groups), registered by its own instance of each worker. A sliding-window
  group's scope carries its window: a hit needs the group's last chunks before the hit's end,
  not the whole prefix (LOOKUP_SCOPE's ``window``), and loads only those. vLLM's CPU backend
  only (its layout on CUDA is not one kvwarden moves for these yet).
- State-space and linear-attention layers (Granite 4, Jamba, Qwen3-Next), and any other kind of
  KV cache group: declined. (``--disable-hybrid-kv-cache-manager`` turns a sliding-window
  hybrid's groups into one of full attention: then it is cached as dense attention.)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from dataplane.client.vllm.lookup import Scope
from dataplane.client.vllm.state import UNCACHED, RequestKey
from dataplane.memory.kvmemory import DTYPE_NAMES
from dataplane.wire.messages import KVFormat

logger = logging.getLogger(__name__)

FULL, MLA, SLIDING = "full", "mla", "sliding"  # the kinds of KV cache group `scopes_of` takes
# vLLM's kv_cache_dtype -> the dtype its chunks are registered and keyed under
KV_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


class Declined(Exception):
    """This engine's KV cannot be cached by kvwarden: the engine runs without the cache (every
    request recomputes, nothing is stored), saying why once at start."""


@dataclass(frozen=True)
class Group:
    """One KV cache group of the engine (vLLM's ``KVCacheGroupSpec``)."""

    kind: str  # FULL, MLA, or vLLM's name of another spec ("SlidingWindowSpec", "MambaSpec"...)
    dtype: str | None  # the tensors' dtype (`dataplane.memory.kvmemory.DTYPE_NAMES`); None: another
    heads: int  # KV heads (1 for a latent)
    head_size: int  # a head's width (the latent's, for MLA)
    block_size: int
    layers: int
    cache_dtype: str = "auto"  # vLLM's kv_cache_dtype: "auto" (the model's dtype), "fp8"...
    window: int = 0  # SLIDING: the tokens a token sees, itself included (vLLM's sliding_window)
    cpu_isa: str = ""  # on vLLM's CPU backend: its attention's ISA ("amx" lays blocks out otherwise)


@dataclass(frozen=True)
class EngineModel:
    name: str  # the served model name
    model_type: str  # the checkpoint's ``model_type`` (for what is said at start)
    tensor_parallel: int
    decode_context_parallel: int
    cpu: bool  # vLLM's CPU backend (else CUDA)
    groups: tuple[Group, ...]


def describe(vllm_config: Any, kv_cache_config: Any) -> EngineModel:
    """The engine's `EngineModel`, read off vLLM's ``VllmConfig`` and ``KVCacheConfig`` by their
    attributes and the class names of their KV cache specs (no vLLM import: vLLM's
    ``MLAAttentionSpec`` is a ``FullAttentionSpec``; a ``SlidingWindowSpec`` exactly, not a kind
    derived from it, is a sliding window)."""

    def group(g: Any) -> Group:
        spec = g.kv_cache_spec
        kind, window, bases = type(spec).__name__, 0, {c.__name__ for c in type(spec).__mro__}
        if "MLAAttentionSpec" in bases:
            kind = MLA
        elif "FullAttentionSpec" in bases:
            kind = FULL
        elif kind == "SlidingWindowSpec":
            kind, window = SLIDING, int(spec.sliding_window)
        heads, head_size = getattr(spec, "num_kv_heads", 0), getattr(spec, "head_size", 0)
        dtype = DTYPE_NAMES.get(getattr(spec, "dtype", None))  # type: ignore[arg-type]
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        isa = cpu_isa(getattr(mc, "dtype", None), spec.block_size, head_size, cache_dtype) if cpu else ""
        return Group(
            kind, dtype, heads, head_size, spec.block_size, len(g.layer_names), cache_dtype, window, isa
        )

    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    cpu = vllm_config.device_config.device_type == "cpu"
    name = mc.served_model_name or mc.model
    return EngineModel(
        str(name[0] if isinstance(name, list) else name),
        str(getattr(mc.hf_config, "model_type", "?")),
        pc.tensor_parallel_size,
        pc.decode_context_parallel_size,
        cpu,
        tuple(group(g) for g in kv_cache_config.kv_cache_groups),
    )


def cpu_isa(dtype: Any, block_size: int, head_size: int, cache_dtype: str) -> str:
    """The ISA vLLM's CPU attention picks for these (its own choice, which decides the blocks'
    layout), or "" when its build does not say."""
    if dtype is None:
        return ""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(dtype, block_size, head_size, cache_dtype))
    except Exception:  # (another vLLM: the layout is taken to be the portable one)
        return ""


def _hybrid(groups: tuple[Group, ...]) -> str:
    """Why a model of several KV cache groups is not cached (yet)."""
    kinds = sorted({g.kind for g in groups})
    if any("Mamba" in k or "Linear" in k or "ShortConv" in k for k in kinds):
        return (
            f"a hybrid with state-space or linear-attention layers (KV cache groups {', '.join(kinds)}): "
            "their state is not cached"
        )
    return (
        f"a hybrid of KV cache groups {', '.join(kinds)}: kvwarden caches full and sliding-window "
        "attention only"
    )


def scopes_of(m: EngineModel) -> tuple[Scope, ...]:
    """The scope of each KV cache group, in vLLM's order of the groups: what each worker
    registers, one instance a group (Declined: a model kvwarden does not cache; ValueError: a
    configuration it refuses)."""
    if len(m.groups) == 1 and m.groups[0].kind != SLIDING:
        return (scope_of(m),)
    if any(g.kind not in (FULL, SLIDING) for g in m.groups):
        raise Declined(
            _hybrid(m.groups)
            if len(m.groups) > 1
            else f"its KV cache ({m.groups[0].kind}) is not one kvwarden caches"
        )
    if not m.cpu:
        raise Declined(
            "sliding-window layers are cached on vLLM's CPU backend only (their layout on CUDA is not "
            "one kvwarden moves yet)"
        )
    if len({g.block_size for g in m.groups}) != 1:
        raise Declined(
            f"its KV cache groups have different block sizes {sorted({g.block_size for g in m.groups})}"
        )
    several = len(m.groups) > 1
    out = []
    for i, g in enumerate(m.groups):
        if g.kind == SLIDING and g.window < 1:
            raise ValueError(f"kvwarden: KV cache group {i}: a sliding window of {g.window} tokens")
        name = f"{m.name}#g{i}" if several else m.name
        s = _scope(
            EngineModel(name, m.model_type, m.tensor_parallel, m.decode_context_parallel, m.cpu, (g,)), g
        )
        out.append(replace(s, window=g.window if g.kind == SLIDING else 0))
    return tuple(out)


def scope_of(m: EngineModel) -> Scope:
    """The scope every worker of a one-group engine of full or latent attention registers
    (Declined: a model kvwarden does not cache, or one of several scopes: `scopes_of`;
    ValueError: a configuration it refuses)."""
    if len(m.groups) != 1 or m.groups[0].kind == SLIDING:
        raise Declined("a model of sliding-window or several KV cache groups has a scope a group (scopes_of)")
    return _scope(m, m.groups[0])


def _scope(m: EngineModel, g: Group) -> Scope:
    kv_format = KVFormat.TOKEN_MAJOR
    if m.cpu:
        kv_format = KVFormat.VLLM_CPU_AMX if g.cpu_isa == "amx" else KVFormat.VLLM_CPU
    if g.kind == MLA:
        if not m.cpu:
            raise Declined(
                "multi-head latent attention is cached on vLLM's CPU backend only (its CUDA "
                "layout is not one kvwarden moves yet)"
            )
        if m.decode_context_parallel > 1:
            raise Declined(
                "multi-head latent attention with decode context parallelism (its ranks hold "
                "different tokens, not the same latent)"
            )
        kv_format = KVFormat.LATENT
    elif g.kind not in (FULL, SLIDING):
        raise Declined(f"its KV cache ({g.kind}) is not one kvwarden caches")
    dtype = g.dtype
    if g.cache_dtype != "auto":
        dtype = KV_DTYPES.get(g.cache_dtype)
        if dtype is None:
            raise Declined(f"its KV cache dtype {g.cache_dtype!r} is not one kvwarden caches yet")
    if dtype is None:
        raise ValueError("kvwarden: the KV cache's dtype is not supported")
    heads = 1 if kv_format is KVFormat.LATENT else g.heads
    return Scope(m.name, m.tensor_parallel, dtype, g.layers, heads, g.head_size, kv_format, g.block_size)


def cached_scopes(
    m: EngineModel, say: bool, kv_codec: str = "none"
) -> tuple[tuple[Scope, ...] | None, str | None]:
    """(the scope of each of the engine's KV cache groups, its chunks stored as ``kv_codec``,
    None), or (None, why the engine runs without the cache), logged when ``say`` (by the
    engine's scheduler: once an engine)."""
    try:
        return tuple(replace(s, kv_codec=kv_codec) for s in scopes_of(m)), None
    except Declined as exc:
        if say:
            logger.warning(
                "kvwarden: the cache is off for model type %r, requests recompute and nothing is stored: %s",
                m.model_type,
                exc,
            )
        return None, str(exc)


NULL_BLOCK = 0  # vLLM's null block (its block pool's first): a sliding window's freed blocks


def groups_of(block_ids: Iterable[Iterable[int]], windows: tuple[int, ...]) -> list[list[int]]:
    """A request's block ids, one list a KV cache group; in a sliding-window group vLLM's null
    block reads -1 (a block never written, `dataplane.memory.copies.ChunkMap`)."""
    return [
        [-1 if b == NULL_BLOCK else int(b) for b in ids] if w else list(ids)
        for ids, w in zip(block_ids, windows, strict=True)
    ]


# the extra keys of vLLM's block hashes (kv_cache_utils.generate_block_hash_extra_keys) that
# request_key folds in; a request whose block keys carry any other kind is never cached
KNOWN_EXTRA_KEYS = frozenset({"lora", "mm", "cache_salt", "prompt_embeds"})
_said: set[str] = set()  # the reasons already logged (once each)


def uncached(why: str) -> RequestKey:
    """UNCACHED, logging ``why`` once for each kind of reason."""
    kind = " ".join(why.split()[:2])  # "adapter path", "multimodal input", "unknown extra"
    if kind not in _said:
        _said.add(kind)
        logger.warning("kvwarden: requests recompute, neither loaded nor stored: %s", why)
    return UNCACHED
