"""The kvwarden keys of vLLM's ``kv_connector_extra_config``: their types, defaults and checks."""

from __future__ import annotations

from typing import Any

from dataplane.wire.messages import KV_CODECS

MODES = ("auto", "engine_driven", "server_driven")


def _flag(value: Any) -> bool:
    """A boolean setting: true or false (JSON), or the strings "true" / "false"."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError(value)


_flag.__name__ = "boolean (true or false)"


def _async_mode(value: Any) -> bool | str:
    """``kvwarden.async_load``: true, false, or "auto"."""
    if isinstance(value, str) and value.lower() == "auto":
        return "auto"
    return _flag(value)


_async_mode.__name__ = 'boolean (true or false) or "auto"'
_KEYS: dict[str, Any] = {
    "kvwarden.url": str,
    "kvwarden.transfer_mode": str,
    "kvwarden.connect_wait_s": float,
    "kvwarden.retry_s": float,
    "kvwarden.lookup_timeout_s": float,
    "kvwarden.request_timeout_s": float,
    "kvwarden.heartbeat_interval_s": float,
    "kvwarden.lookup_wait_s": float,
    "kvwarden.kv_events_endpoint": str,
    "kvwarden.kv_events_topic": str,
    "kvwarden.async_load": _async_mode,
    "kvwarden.prefetch": _flag,
    "kvwarden.store_tail": _flag,
    "kvwarden.kv_compression": str,
}
_MAY_BE_ZERO = {"kvwarden.lookup_wait_s"}
_DEFAULTS: dict[str, Any] = {
    "kvwarden.url": "tcp://127.0.0.1:5555",
    "kvwarden.transfer_mode": "auto",
    "kvwarden.connect_wait_s": 5.0,  # at engine start, for a server that is starting too
    "kvwarden.retry_s": 2.0,
    "kvwarden.lookup_timeout_s": 1.0,
    "kvwarden.request_timeout_s": 30.0,
    "kvwarden.heartbeat_interval_s": 5.0,
    # how long a request may wait for its prefix being stored (by this engine or another) to
    # land rather than recompute it; 0: never wait
    "kvwarden.lookup_wait_s": 1.0,
    # the server's kv_events_endpoint (as this engine reaches it): its events join the engine's
    # own (`dataplane.client.vllm.events.EventRelay`); none: not forwarded
    "kvwarden.kv_events_endpoint": None,
    "kvwarden.kv_events_topic": "",
    # how a hit is loaded: "auto", off the step (vLLM's asynchronous loads: the request waits
    # while running requests keep decoding) when it reads the file tier or Redis, on the step (a
    # memory copy, before the forward pass: no step of waiting) when the server holds it all in L1;
    # true: always off the step; false: always on it
    "kvwarden.async_load": "auto",
    # a request the scheduler is given asks the server at once to bring its prefix from the
    # slower tiers (file tier, Redis) into L1 (PREFETCH_SCOPE), before it is scheduled
    "kvwarden.prefetch": True,
    # a kv_producer's opt-in: each prompt's tail past its last full chunk is stored too, as a
    # chunk of its own (`dataplane.client.vllm.tail`), so the decode engine it hands off to
    # computes only the prompt's last token
    "kvwarden.store_tail": False,
    # how this engine's chunks are stored, in every tier: "none" (as the engine holds them), or
    # "int8" (quantized by the worker, about half the bytes, lossy: `dataplane.memory.int8`);
    # part of the chunks' scope, so an engine that did not opt in never reads int8 chunks
    "kvwarden.kv_compression": "none",
}


ROLES = ("kv_producer", "kv_consumer", "kv_both")  # vLLM's kv_role: stores only, loads only, both
# what acts only on loads: set for a kv_producer (which never loads), it would do nothing
_LOADS_ONLY = ("kvwarden.async_load", "kvwarden.prefetch", "kvwarden.lookup_wait_s")


def connector_settings(extra: dict[str, Any] | None, role: str = "kv_both") -> dict[str, Any]:
    """``kv_connector_extra_config``'s kvwarden keys, checked (ValueError naming the key), for
    an engine of vLLM's ``kv_role`` ``role``."""
    if role not in ROLES:
        raise ValueError(f"kv_role {role!r}: kvwarden takes {', '.join(ROLES)}")
    if role == "kv_producer":
        for key in _LOADS_ONLY:
            if key in (extra or {}):
                raise ValueError(
                    f"kv_connector_extra_config[{key!r}]: a kv_producer never loads, so it would do "
                    "nothing; leave it out, or use kv_role kv_both"
                )
    out = dict(_DEFAULTS)
    for key, value in (extra or {}).items():
        if not key.startswith("kvwarden."):
            continue
        if key not in _KEYS:
            raise ValueError(f"kv_connector_extra_config: unknown key {key!r} (known: {', '.join(_KEYS)})")
        try:
            out[key] = _KEYS[key](value)
        except (TypeError, ValueError):
            raise ValueError(
                f"kv_connector_extra_config[{key!r}]: {value!r} is not a {_KEYS[key].__name__}"
            ) from None
        if _KEYS[key] is float and not (out[key] > 0 or (key in _MAY_BE_ZERO and out[key] == 0)):
            bound = ">= 0" if key in _MAY_BE_ZERO else "> 0"
            raise ValueError(f"kv_connector_extra_config[{key!r}]: must be {bound}, got {value!r}")
        if _KEYS[key] is float and not out[key] < float("inf"):
            raise ValueError(f"kv_connector_extra_config[{key!r}]: must be finite, got {value!r}")
    ep = out["kvwarden.kv_events_endpoint"]
    if ep is not None and not ep.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(
            f"kv_connector_extra_config['kvwarden.kv_events_endpoint']: {ep!r} is not a ZMQ endpoint"
        )
    if ep is None and out["kvwarden.kv_events_topic"]:
        raise ValueError(
            "kv_connector_extra_config['kvwarden.kv_events_topic'] needs kvwarden.kv_events_endpoint"
        )
    if out["kvwarden.store_tail"] and role != "kv_producer":
        raise ValueError(
            f"kv_connector_extra_config['kvwarden.store_tail']: a tail is loaded only by a decode "
            f"engine given a kv_producer's handoff, so on a {role} it would do nothing; set it on "
            "the kv_producer"
        )
    if out["kvwarden.store_tail"] and out["kvwarden.transfer_mode"] == "server_driven":
        raise ValueError(
            "kv_connector_extra_config['kvwarden.store_tail']: server-driven transfers cannot load "
            "a tail chunk; use transfer_mode engine_driven (the CPU default)"
        )
    _check_codec(out)
    if out["kvwarden.transfer_mode"] not in MODES:
        raise ValueError(
            f"kv_connector_extra_config['kvwarden.transfer_mode']: {out['kvwarden.transfer_mode']!r}; "
            f"use {', '.join(MODES)}"
        )
    return out


def _check_codec(out: dict[str, Any]) -> None:
    """``kvwarden.kv_compression`` against the settings it cannot go with."""
    codec = out["kvwarden.kv_compression"]
    if codec not in KV_CODECS:
        raise ValueError(
            f"kv_connector_extra_config['kvwarden.kv_compression']: {codec!r}; use {', '.join(KV_CODECS)}"
        )
    if codec != "none" and out["kvwarden.transfer_mode"] == "server_driven":
        raise ValueError(
            f"kv_connector_extra_config['kvwarden.kv_compression']: {codec} is quantized by the worker "
            "as it copies, which server-driven transfers do not; use transfer_mode engine_driven"
        )
    if codec != "none" and out["kvwarden.store_tail"]:
        raise ValueError(
            f"kv_connector_extra_config['kvwarden.kv_compression']: {codec} chunks are whole chunks; "
            "a tail (kvwarden.store_tail) is not quantized yet: leave one of them out"
        )


def adapter_options(cfg: dict[str, Any]) -> dict[str, Any]:
    """The `dataplane.client.WorkerAdapter` keywords the checked settings ``cfg`` give."""
    return dict(
        heartbeat_interval=cfg["kvwarden.heartbeat_interval_s"],
        request_timeout=cfg["kvwarden.request_timeout_s"],
        kv_compression=cfg["kvwarden.kv_compression"],
    )
