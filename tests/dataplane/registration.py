"""Typed REGISTER messages for real shared-memory caches, as `WorkerAdapter` builds them."""

from __future__ import annotations

import os

import torch

from dataplane.client.kvalloc import describe_caches
from dataplane.wire.messages import EngineRegister, KVFormat, Register, TransferMode

SECRET = bytes(range(16))  # the secret the tests' instances register with


def register_message(
    instance_id: int, caches: list[torch.Tensor], model: str = "m", secret: bytes = SECRET
) -> Register:
    layout = describe_caches(caches)
    return Register(
        instance_id,
        secret,
        model,
        1,
        0,
        TransferMode.SERVER_DRIVEN,
        layout.memory,
        layout.dtype,
        layout.kv_shape,
        os.getpid(),
        layout.layers,
    )


def engine_register_message(instance_id: int, pool_chunks: int = 4, secret: bytes = SECRET) -> EngineRegister:
    """An engine-driven REGISTER for the tiny layout of the data-plane tests (2 layers, 2 heads,
    head dim 8)."""
    return EngineRegister(
        instance_id,
        secret,
        "m",
        1,
        0,
        "bfloat16",
        2,
        2,
        8,
        pool_chunks,
        os.getpid(),
        KVFormat.TOKEN_MAJOR,
        16,
    )


def segment_of(caches: list[torch.Tensor]) -> str:
    """The shared-memory segment behind ``caches``."""
    return describe_caches(caches).segments[0]
