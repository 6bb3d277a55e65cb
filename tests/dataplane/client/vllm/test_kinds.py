"""Which models kvwarden caches, decided from a plain description of the engine's model
(`dataplane.client.vllm.kinds`): the scope each kind registers, or why the cache is declined."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dataplane.client.vllm.kinds import (
    FULL,
    MLA,
    SLIDING,
    Declined,
    EngineModel,
    Group,
    describe,
    scope_of,
    scopes_of,
)
from dataplane.wire.messages import KVFormat


def model(*groups: Group, cpu: bool = True, tp: int = 1, dcp: int = 1) -> EngineModel:
    return EngineModel("m", "llama", tp, dcp, cpu, groups)


DENSE = Group(FULL, "bfloat16", 8, 128, 128, 32)
LATENT = Group(MLA, "bfloat16", 1, 576, 16, 4)


def test_dense_attention_is_k_and_v_in_the_engines_layout() -> None:
    cpu, cuda = scope_of(model(DENSE)), scope_of(model(DENSE, cpu=False, tp=2))
    assert (cpu.kv_format, cpu.heads, cpu.head_dim, cpu.dtype) == (KVFormat.VLLM_CPU, 8, 128, "bfloat16")
    assert (cuda.kv_format, cuda.world_size) == (KVFormat.TOKEN_MAJOR, 2)


def test_blocks_laid_out_for_amx_are_a_format_of_their_own() -> None:
    """vLLM's CPU attention on AMX tiles lays a block out otherwise (pairs of channels of K,
    pairs of tokens of V): such chunks must never be read as the portable layout's."""
    amx = scope_of(model(Group(FULL, "bfloat16", 8, 128, 128, 32, cpu_isa="amx")))
    vec = scope_of(model(Group(FULL, "bfloat16", 8, 128, 128, 32, cpu_isa="vec")))
    assert (amx.kv_format, vec.kv_format) == (KVFormat.VLLM_CPU_AMX, KVFormat.VLLM_CPU)


def test_latent_attention_is_one_latent_on_the_cpu_backend_and_declined_elsewhere() -> None:
    s = scope_of(model(LATENT, tp=2))
    assert (s.kv_format, s.heads, s.head_dim, s.block_size, s.world_size) == (KVFormat.LATENT, 1, 576, 16, 2)
    with pytest.raises(Declined, match="CPU backend only"):
        scope_of(model(LATENT, cpu=False))
    with pytest.raises(Declined, match="decode context parallelism"):
        scope_of(model(LATENT, dcp=2))


@pytest.mark.parametrize(
    ("cache_dtype", "dtype"),
    [
        ("auto", "bfloat16"),
        ("fp8", "float8_e4m3fn"),
        ("fp8_e4m3", "float8_e4m3fn"),
        ("fp8_e5m2", "float8_e5m2"),
    ],
)
def test_quantized_kv_is_registered_and_keyed_as_what_it_is(cache_dtype: str, dtype: str) -> None:
    g = Group(FULL, "uint8" if cache_dtype != "auto" else "bfloat16", 8, 128, 128, 32, cache_dtype)
    assert scope_of(model(g)).dtype == dtype


@pytest.mark.parametrize(
    "cache_dtype", ["int8_per_token_head", "fp8_per_token_head", "int4_per_token_head", "int8"]
)
def test_kv_kinds_with_their_own_scales_are_declined(cache_dtype: str) -> None:
    with pytest.raises(Declined, match=f"KV cache dtype '{cache_dtype}'"):
        scope_of(model(Group(FULL, "int8", 8, 128, 128, 32, cache_dtype)))


def test_other_caches_and_state_space_hybrids_are_declined() -> None:
    for kind in ("MambaSpec", "ChunkedLocalAttentionSpec"):
        with pytest.raises(Declined, match=kind):
            scopes_of(model(Group(kind, "bfloat16", 8, 128, 128, 32)))
    with pytest.raises(Declined, match=r"state-space or linear-attention layers .*MambaSpec"):
        scopes_of(model(DENSE, Group("MambaSpec", None, 0, 0, 128, 3)))
    with pytest.raises(Declined, match=r"KV cache groups ChunkedLocalAttentionSpec, full"):
        scopes_of(model(DENSE, Group("ChunkedLocalAttentionSpec", "bfloat16", 8, 128, 128, 32)))
    with pytest.raises(ValueError, match="dtype is not supported"):
        scope_of(model(Group(FULL, None, 8, 128, 128, 32)))


def test_each_group_of_a_sliding_window_hybrid_is_a_scope_of_its_own() -> None:
    window = Group(SLIDING, "bfloat16", 8, 128, 128, 32, window=512)
    full, sw1, sw2 = scopes_of(model(DENSE, window, window))
    assert (full.model_name, sw1.model_name, sw2.model_name) == ("m#g0", "m#g1", "m#g2")
    assert (full.window, sw1.window) == (0, 512) and sw1.num_layers == 32
    assert sw1.kv_format is KVFormat.VLLM_CPU and sw1 != sw2  # (their names keep their chunks apart)
    (alone,) = scopes_of(model(window))  # every layer a sliding window: the served name
    assert alone.model_name == "m" and alone.window == 512
    assert alone.window_chunks(256) == 2 and alone.first_chunk(1024, 256) == 2
    with pytest.raises(Declined, match="CPU backend only"):
        scopes_of(model(DENSE, window, cpu=False))
    with pytest.raises(Declined, match="different block sizes"):
        scopes_of(model(DENSE, Group(SLIDING, "bfloat16", 8, 128, 64, 32, window=512)))
    with pytest.raises(Declined, match="kvwarden caches full and sliding-window attention only"):
        scopes_of(model(LATENT, window))
    with pytest.raises(ValueError, match="a sliding window of 0 tokens"):
        scopes_of(model(DENSE, Group(SLIDING, "bfloat16", 8, 128, 128, 32)))
    with pytest.raises(Declined, match="scopes_of"):
        scope_of(model(DENSE, window))


def test_an_engine_is_described_from_vllms_config_by_attributes_and_spec_class_names() -> None:
    """(vLLM's own objects are read in the engine tests; these stand in for them by shape.)"""
    import torch

    class FullAttentionSpec:
        def __init__(self, heads: int = 8, size: int = 128) -> None:
            self.num_kv_heads, self.head_size, self.dtype, self.block_size = heads, size, torch.bfloat16, 128

    class MLAAttentionSpec(FullAttentionSpec):  # as in vLLM: a kind of full attention
        pass

    class SlidingWindowSpec:  # (in vLLM, not a kind of full attention)
        num_kv_heads, head_size, dtype, block_size, sliding_window = 8, 128, torch.bfloat16, 128, 512

    class MambaSpec:
        block_size = 128

    def group(spec: object, n: int) -> SimpleNamespace:
        return SimpleNamespace(kv_cache_spec=spec, layer_names=[f"l{i}" for i in range(n)])

    cfg = SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype="auto"),
        model_config=SimpleNamespace(
            served_model_name=["served"], model="/m", hf_config=SimpleNamespace(model_type="gemma3")
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=2, decode_context_parallel_size=1),
        device_config=SimpleNamespace(device_type="cpu"),
    )
    groups = [
        group(FullAttentionSpec(), 2),
        group(SlidingWindowSpec(), 2),
        group(MLAAttentionSpec(1, 576), 1),
        group(MambaSpec(), 3),
    ]
    m = describe(cfg, SimpleNamespace(kv_cache_groups=groups))
    assert (m.name, m.model_type, m.tensor_parallel, m.cpu) == ("served", "gemma3", 2, True)
    assert [(g.kind, g.window, g.layers) for g in m.groups] == [
        (FULL, 0, 2),
        (SLIDING, 512, 2),
        (MLA, 0, 1),
        ("MambaSpec", 0, 3),
    ]
    assert m.groups[0].dtype == "bfloat16" and m.groups[2].head_size == 576 and m.groups[3].dtype is None
