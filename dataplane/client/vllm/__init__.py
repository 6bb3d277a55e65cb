"""kvwarden as vLLM's KV connector: the one place vLLM meets kvwarden.

Users name this package in vLLM's configuration, and it stays the connector's one import path::

    "kv_connector": "KVWardenConnector", "kv_connector_module_path": "dataplane.client.vllm"

Door: `KVWardenConnector` (and its metadata classes), loaded from `connector` when first asked
for, so the parts that need no vLLM import without it. Inside: `connector` (the only module that
imports vLLM: the scheduler side and the worker side of vLLM's connector API), `kinds` (which
models and requests are cached, and how: a model kind's scope, or why the cache is declined),
`state` (the
scheduler's plans, lookups and the step's loads and saves), `wait` (read-your-writes: prefixes
being saved, waited for or copied), `worker` (registration, the saver thread, loads and the copy
into vLLM's blocks), `events` (vLLM's KV events from the server's), `settings` (the connector's
``kvwarden.*`` options).

It may import the generic client (`dataplane.client`), `dataplane.memory` and `dataplane.wire`;
never the server side, and the generic client never imports it (import-linter keeps both so).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["KVWardenConnector", "KVWardenConnectorMetadata", "KVWardenWorkerMetadata"]


def __getattr__(name: str) -> Any:
    """The connector's classes, imported (with vLLM) on first use: vLLM looks the class up here."""
    if name in __all__:
        return getattr(importlib.import_module("dataplane.client.vllm.connector"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
