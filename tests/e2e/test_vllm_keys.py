"""The vLLM connector's key context of a request (``request_key``), from real vLLM ``Request``
objects built in vLLM's environment (``.venv-vllm``): cache salt, LoRA adapter, multimodal
inputs at two offsets with two identifiers, prompt embeddings, and extra keys it cannot name.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from tests.e2e.vllm_support import VLLM_PYTHON, require_vllm
from tests.helpers import ROOT, subprocess_env

pytestmark = pytest.mark.xdist_group("vllm")  # one worker: the vLLM engines

Keyed = tuple[dict[str, Any], str]  # each case's key context, and what the connector logged

SCRIPT = r"""
import json, logging, sys
import torch
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request
from dataplane.client.vllm.connector import prompt_of
from dataplane.client.vllm.request_keys import request_key
from dataplane.client.vllm.state import UNCACHED
from dataplane.storage.keys import chunk_keys

logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
BLOCK, CS = 16, 32
lora_dir = sys.argv[1]


def req(tokens=None, **kw):
    return Request("r", tokens, SamplingParams(max_tokens=1), None, **kw)


def image(ident, offset, length=40):
    return MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


def describe(r):
    k = request_key(r, BLOCK)
    if k is UNCACHED:
        return "uncached"
    if k is None:
        return None
    prompt = prompt_of(r.prompt_token_ids, r.prompt_embeds)
    keys = chunk_keys(b"scope", torch.tensor(list(prompt)).numpy(), CS, k)
    return {"salt": k.salt.hex(), "namespace": k.namespace.hex(),
            "spans": [[s, e, d.hex()] for s, e, d in k.spans], "keys": [x.hex() for x in keys]}


toks = list(range(3, 3 + 6 * CS))
out = {
    "plain": describe(req(toks)),
    "salt_a": describe(req(toks, cache_salt="tenant-a")),
    "salt_b": describe(req(toks, cache_salt="tenant-b")),
    "mm": describe(req(toks, mm_features=[image("h1", 10), image("h2", 100)])),
    "mm_swapped": describe(req(toks, mm_features=[image("h2", 10), image("h1", 100)])),
    "mm_moved": describe(req(toks, mm_features=[image("h1", 10), image("h2", 101)])),
    "lora": describe(req(toks, lora_request=LoRARequest("sql", 1, lora_dir))),
    "lora_missing": describe(req(toks, lora_request=LoRARequest("gone", 2, lora_dir + "-missing"))),
    "lora_missing_again": describe(req(toks, lora_request=LoRARequest("gone", 2, lora_dir + "-missing"))),
}
emb = torch.randn(4 * CS, 8)
emb2 = emb.clone()
emb2[3 * CS + 1] += 1
out["embeds"] = describe(req(None, prompt_embeds=emb))
out["embeds_same"] = describe(req(None, prompt_embeds=emb.clone()))
out["embeds_changed"] = describe(req(None, prompt_embeds=emb2))
real = kv_cache_utils.generate_block_hash_extra_keys
kv_cache_utils.generate_block_hash_extra_keys = lambda *a, **k: ((("new_kind", 1),), 0)
out["unknown"] = describe(req(toks))
kv_cache_utils.generate_block_hash_extra_keys = real
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Keyed:
    require_vllm()
    lora = tmp_path_factory.mktemp("lora")
    (lora / "adapter_model.safetensors").write_bytes(b"weights")
    (lora / "adapter_config.json").write_text("{}")
    argv = [str(VLLM_PYTHON), "-c", SCRIPT, str(lora)]
    p = subprocess.run(argv, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def test_salts_key_apart_and_a_plain_request_has_no_context(keyed: Keyed) -> None:
    k, _ = keyed
    assert k["plain"] is None
    a, b = k["salt_a"], k["salt_b"]
    assert bytes.fromhex(a["salt"]) == b"tenant-a" and a["namespace"] == "" and a["spans"] == []
    assert not set(a["keys"]) & set(b["keys"])


def test_multimodal_inputs_key_their_chunks_by_identifier_and_offset(
    keyed: tuple[dict[str, Any], str],
) -> None:
    k, _ = keyed
    mm = k["mm"]
    assert [(s, e) for s, e, _ in mm["spans"]] == [(10, 50), (100, 140)]
    assert mm["spans"][0][2] != mm["spans"][1][2]
    # the chunk holding the first image and every later one differ when the identifiers swap
    assert not set(mm["keys"]) & set(k["mm_swapped"]["keys"])
    # the second image one token later: chunks before it are shared, from its chunk on not
    moved = k["mm_moved"]["keys"]
    assert moved[:3] == mm["keys"][:3] and not set(moved[3:]) & set(mm["keys"])


def test_a_lora_adapter_is_a_namespace_and_a_missing_one_recomputes(
    keyed: tuple[dict[str, Any], str],
) -> None:
    k, log = keyed
    assert k["lora"]["namespace"].startswith(b"lora:".hex()) and k["lora"]["salt"] == ""
    assert k["lora_missing"] == k["lora_missing_again"] == "uncached"
    assert log.count("cannot be read") == 1  # said once in the log
    assert k["unknown"] == "uncached" and "new_kind" in log


def test_prompt_embeddings_key_each_block(keyed: Keyed) -> None:
    k, _ = keyed
    e = k["embeds"]
    assert len(e["spans"]) == 8 and e["keys"] == k["embeds_same"]["keys"]
    changed = k["embeds_changed"]["keys"]  # token 3 * CS + 1 of 4 chunks: chunk 3 on
    assert changed[:3] == e["keys"][:3] and changed[3] != e["keys"][3]
    # token ids are all 0 there: without the spans every embeddings request would collide
    assert not set(e["keys"]) & set(k["plain"] or [])
