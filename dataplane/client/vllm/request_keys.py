"""What a vLLM request's KV is keyed on (``request_key``): the cache salt, the LoRA adapter with a
digest of its files, multimodal inputs and prompt embeddings, as vLLM folds them into its own
block keys; ``UNCACHED`` when any of it cannot be named. Read from the request by its
attributes (vLLM's own helper for the extra keys is imported when called)."""

from __future__ import annotations

from typing import Any

from dataplane.client.keys import (
    UninterpretableKey,
    adapter_namespace,
    embeds_spans,
    key_context,
    mm_spans,
)
from dataplane.client.vllm.kinds import KNOWN_EXTRA_KEYS, uncached
from dataplane.client.vllm.state import RequestKey


def request_key(request: Any, block_size: int) -> RequestKey:
    """The key context of a request, from what vLLM keys its blocks on: ``UNCACHED`` when any
    of it cannot be named (logged once for each kind of reason)."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    n = request.num_prompt_tokens
    if n > 0:  # the kinds of extra key vLLM folds into the first block, as it computes them
        extra, _ = generate_block_hash_extra_keys(request, 0, min(block_size, n), 0)
        kinds = {
            k[0] if isinstance(k, tuple) and k and isinstance(k[0], str) else repr(k) for k in extra or ()
        }
        if kinds - KNOWN_EXTRA_KEYS:
            return uncached(f"unknown extra keys: block keys carry {sorted(kinds - KNOWN_EXTRA_KEYS)}")
    try:
        lora = request.lora_request
        adapter = b""
        if lora is not None:
            path = lora.lora_path
            if not path:
                raise UninterpretableKey(f"adapter: {lora.lora_name!r} has no local path")
            adapter = adapter_namespace(lora.lora_name, path)
        spans = mm_spans(
            (f.identifier, f.mm_position.offset, f.mm_position.length) for f in request.mm_features
        )
        if request.prompt_embeds is not None:
            spans += embeds_spans(request.prompt_embeds, block_size)
        return key_context(request.cache_salt, adapter, spans)
    except UninterpretableKey as exc:
        return uncached(str(exc))
