"""Decodes KV-event payloads with vLLM's own classes (run by vLLM's environment's python).

stdin: one payload a line, base64; stdout: one JSON line a payload: ``{"ts", "rank", "events"}``
each event ``{"type": class name, ...fields}`` as msgspec.to_builtins gives them (bytes as
base64), or ``{"error": "..."}`` when vLLM's decoder refuses the payload."""

from __future__ import annotations

import base64
import json
import sys

import msgspec
from vllm.distributed.kv_events import KVEventBatch


def main() -> None:
    dec = msgspec.msgpack.Decoder(type=KVEventBatch)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        try:
            batch = dec.decode(base64.b64decode(line.strip()))
        except msgspec.ValidationError as exc:
            print(json.dumps({"error": str(exc)}), flush=True)
            continue
        events = [{**msgspec.to_builtins(ev), "type": type(ev).__name__} for ev in batch.events]
        print(json.dumps({"ts": batch.ts, "rank": batch.data_parallel_rank, "events": events}), flush=True)


if __name__ == "__main__":
    main()
