"""The vLLM tests' reference: one process builds the tiny model and its LoRA adapters, then one
engine without kvwarden (nor vLLM's own prefix caching; LoRA on) answers every case.

    .venv-vllm/bin/python tests/e2e/vllm_reference.py JOB.json

The job: ``{"model": dir, "adapters": {"a": dir, "b": dir}, "engine_lora": {engine options},
"max_tokens": n, "cases": {name: {"prompt": [token ids], "cache_salt": str | null, "lora":
{"name", "id", "path"} | null}}, "answers": path}``. Once every case is answered it writes
``{name: {"tokens": [...], "cached": n}}`` to ``answers`` (whole: renamed into place), then shuts
the engine down (seconds, which the caller need not wait for). The engine is built like
``kvbench.vllm_engine``'s (``build``, ``request``), the model and adapters with
``kvbench.vllm_model``'s ``TINY`` shape and the seeds the tests have always used (1 for adapter
``a``, 2 for ``b``); sampling is greedy.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    from kvbench.vllm_model import TINY, build_model, write_lora

    build_model(job["model"], TINY)
    for name, seed in (("a", 1), ("b", 2)):
        write_lora(job["adapters"][name], TINY, seed=seed)

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["HF_HUB_OFFLINE"] = "1"
    from vllm import SamplingParams

    from kvbench.vllm_engine import build, request

    llm = build(job["model"], None, {}, job["engine_lora"])
    params = SamplingParams(max_tokens=int(job["max_tokens"]), temperature=0, detokenize=False)
    answers: dict[str, Any] = {}
    for name, cmd in job["cases"].items():
        prompt, lora_request = request(cmd)
        out = llm.generate([prompt], params, use_tqdm=False, lora_request=lora_request)[0]
        answers[name] = {"tokens": list(out.outputs[0].token_ids), "cached": int(out.num_cached_tokens or 0)}
    part = Path(job["answers"] + ".part")
    part.write_text(json.dumps(answers))
    part.rename(job["answers"])
    del llm


if __name__ == "__main__":  # vLLM's engine processes import this module again (spawn)
    main()
