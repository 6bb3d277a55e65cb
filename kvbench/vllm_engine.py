"""A real vLLM engine (offline ``LLM``) that a test drives over stdin/stdout, one JSON line each.

    python -m kvbench.vllm_engine MODEL_DIR [KVWARDEN_URL]    (no URL: no connector)

Prints ``@kvw {"ready": true, "pid": ...}`` once the engine is built, then for each line
``{"prompt": [token ids], "max_tokens": n}`` answers ``{"tokens": [...], "logprobs": [...],
"cached": n, "s": s}`` (``logprobs``: each output token's; ``s``: the request's time in the
engine). A line may also carry ``"cache_salt": str`` (put in the prompt, as vLLM takes it) and
``"lora": {"name": str, "id": int, "path": str}`` (the request's ``LoRARequest``) and
``"kv_transfer_params": {...}`` (what a disaggregated prefill answered, for the decode; every
answer carries the request's own, ``null`` without), and ``"prompt_logprobs": true`` (the
answer's ``prompt_logprobs``: ``[position, logprob]`` of each prompt token the engine computed,
its hit still loaded).
``{"reset": true}`` resets the engine's prefix cache and the connector's
(``reset_prefix_cache(reset_connector=True)``) and answers ``{"reset": bool}``;
``{"perturb": seed}`` changes every weight in place, as a trainer's weight update does (each
multiplied by 1 + N(0, 0.5)), and answers ``{"perturbed": seed}``.
``{"quit": true}`` (or end of input) shuts the engine down. Run with the Python of the vLLM
environment (``.venv-vllm``); greedy sampling, so outputs are comparable token for token.

Environment: ``KVWARDEN_ENGINE_PREFIX_CACHING=1`` turns vLLM's own prefix caching on (off by
default), ``force`` on even where vLLM's platform turns it off (multi-head latent attention on
its CPU backend, whose decode path after a prefix hit of all but one token does not compute what
a prefill does: tests compare kvwarden's hits there with vLLM's own at the same boundaries);
``KVWARDEN_ENGINE_OPTIONS``, a JSON object, holds more of ``LLM``'s options (such as
``{"disable_hybrid_kv_cache_manager": true}``); ``KVWARDEN_ENGINE_LORA``, a JSON object, turns
LoRA on with those engine options (such as ``{"max_lora_rank": 8, "max_loras": 2}``; ``{}``:
vLLM's defaults); ``KVWARDEN_ENGINE_CONNECTOR_EXTRA`` holds more ``kv_connector_extra_config``
keys, as JSON; ``KVWARDEN_ENGINE_KV_EVENTS`` the engine's own KV events (vLLM's
``KVEventsConfig`` fields, as JSON); ``KVWARDEN_ENGINE_ROLE`` the connector's ``kv_role``
(``kv_both`` by default); ``KVWARDEN_ENGINE_ONE_PROCESS=1`` runs the engine core in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and, with one rank, its worker too (the ``uni`` executor, a
one-GPU engine's): the connector's scheduler and worker halves share a process, and the engine
starts in about a third of the time on two cores (three Pythons importing vLLM become one). Used
by `kvbench.vllm` and the vLLM tests.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def force_prefix_caching() -> None:
    """Keep vLLM's own prefix cache on where its CPU platform turns it off (MLA models). Run at
    import, so the engine core process, which imports this module again, does it too."""
    from vllm.platforms import cpu

    check = cpu.CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def keep_on(cls: Any, vllm_config: Any) -> None:
        check(cls, vllm_config)
        vllm_config.cache_config.enable_prefix_caching = True

    cpu.CpuPlatform.check_and_update_config = classmethod(keep_on)  # type: ignore[method-assign,assignment]


if os.environ.get("KVWARDEN_ENGINE_PREFIX_CACHING") == "force":
    force_prefix_caching()


def one_process() -> bool:
    return os.environ.get("KVWARDEN_ENGINE_ONE_PROCESS") == "1"


def build(model: str, url: str | None, extra: dict[str, Any], lora: dict[str, Any] | None) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {}
    if url:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVWardenConnector",
            kv_connector_module_path="dataplane.client.vllm",
            kv_role=os.environ.get("KVWARDEN_ENGINE_ROLE") or "kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"kvwarden.url": url, **extra},
        )
    if lora is not None:
        kw.update(enable_lora=True, **lora)
    prefix = os.environ.get("KVWARDEN_ENGINE_PREFIX_CACHING") in ("1", "force")
    events = os.environ.get("KVWARDEN_ENGINE_KV_EVENTS")
    if events:  # the engine's own KV events (vLLM's KVEventsConfig, as JSON)
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(**json.loads(events))
    options = json.loads(os.environ.get("KVWARDEN_ENGINE_OPTIONS") or "{}")
    if one_process() and options.get("tensor_parallel_size", 1) == 1:
        kw["distributed_executor_backend"] = "uni"  # (the worker in the engine core's process)
    kw.update(options)
    return LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        enable_prefix_caching=prefix,
        dtype="bfloat16",
        **kw,
    )


def request(cmd: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """The prompt and the LoRA request (or None) of a request line."""
    prompt: dict[str, Any] = {"prompt_token_ids": cmd["prompt"]}
    if cmd.get("cache_salt") is not None:
        prompt["cache_salt"] = str(cmd["cache_salt"])
    lora = cmd.get("lora")
    if lora is None:
        return prompt, None
    from vllm.lora.request import LoRARequest

    return prompt, LoRARequest(str(lora["name"]), int(lora["id"]), str(lora["path"]))


def scored(prompt: list[int], logprobs: Any) -> list[list[float]]:
    """[position, logprob of the prompt's token there] for each position vLLM scored (not the
    first, nor those of a hit: their logits were never computed)."""
    return [
        [i, float(lp[prompt[i]].logprob)]
        for i, lp in enumerate(logprobs or [])
        if lp is not None and prompt[i] in lp
    ]


def perturb(worker: Any, seed: int) -> None:
    """A weight update, in the worker: every weight multiplied by 1 + N(0, 0.5), drawn from
    ``seed`` (what the KV computed before it no longer matches)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in worker.model_runner.model.parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32) * 0.5
            p.mul_((1.0 + noise).to(p.dtype))


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["HF_HUB_OFFLINE"] = "1"
    if one_process():
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # ({"perturb"}: a function to the workers)
    model = sys.argv[1]
    url = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] else None
    extra = json.loads(os.environ.get("KVWARDEN_ENGINE_CONNECTOR_EXTRA", "{}"))
    lora_env = os.environ.get("KVWARDEN_ENGINE_LORA")
    from vllm import SamplingParams

    llm = build(model, url, extra, json.loads(lora_env) if lora_env else None)
    print("@kvw " + json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        if "reset" in cmd:
            print(
                "@kvw " + json.dumps({"reset": bool(llm.reset_prefix_cache(reset_connector=True))}),
                flush=True,
            )
            continue
        if "perturb" in cmd:
            llm.collective_rpc(perturb, args=(int(cmd["perturb"]),))
            print("@kvw " + json.dumps({"perturbed": int(cmd["perturb"])}), flush=True)
            continue
        handed = cmd.get("kv_transfer_params")  # (a disaggregated prefill's, for its decode)
        params = SamplingParams(
            max_tokens=int(cmd.get("max_tokens", 8)),
            temperature=0,
            detokenize=False,
            logprobs=0,
            extra_args={"kv_transfer_params": handed} if handed is not None else None,
            # scored prompts still load their hits (vLLM skips a hit for them by default)
            prompt_logprobs=0 if cmd.get("prompt_logprobs") else None,
            skip_reading_prefix_cache=False if cmd.get("prompt_logprobs") else None,
        )
        prompt, lora_request = request(cmd)
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False, lora_request=lora_request)[0]
        elapsed = time.perf_counter() - t0
        chosen = out.outputs[0]
        answer = {
            "tokens": list(chosen.token_ids),
            # each output token's logprob (greedy: the chosen one), as computed
            "logprobs": [
                float(lp[t].logprob) for t, lp in zip(chosen.token_ids, chosen.logprobs or [], strict=False)
            ],
            "cached": int(out.num_cached_tokens or 0),
            "s": elapsed,
            "kv_transfer_params": getattr(out, "kv_transfer_params", None),
        }
        if cmd.get("prompt_logprobs"):
            answer["prompt_logprobs"] = scored(cmd["prompt"], out.prompt_logprobs)
        print("@kvw " + json.dumps(answer), flush=True)
    del llm


if __name__ == "__main__":
    main()
