"""Worker-side KV memory: ``allocate_kv_caches`` and the layout a REGISTER describes.

On CPU all layers live in one shared-memory segment (see `dataplane.shm` for who unlinks it
and when); on CUDA they are ordinary device tensors shared through CUDA IPC handles.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from dataplane.kvmemory import DTYPE_NAMES
from dataplane.shm import Segment

# segments made by allocate_kv_caches in this process: name -> (segment, base address)
_SEGMENTS: dict[str, tuple[Segment, int]] = {}
_SEGMENTS_LOCK = threading.Lock()  # guards _SEGMENTS


def _unlink_all_at_exit() -> None:
    with _SEGMENTS_LOCK:
        for seg, _ in _SEGMENTS.values():
            seg.unlink()
        _SEGMENTS.clear()


atexit.register(_unlink_all_at_exit)


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype = torch.bfloat16,
                       device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """One ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer.

    On CPU all layers live in one shared-memory segment the server maps (zero-filled);
    on CUDA they are ordinary device tensors shared through CUDA IPC at registration.
    """
    for name, v in (("num_layers", num_layers), ("num_blocks", num_blocks),
                    ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                    ("head_dim", head_dim)):
        if int(v) <= 0:
            raise ValueError(f"{name} must be > 0, got {v}")
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} is not supported; use one of {sorted(DTYPE_NAMES.values())}")
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    dev = torch.device(device)
    if dev.type == "cuda":
        full = torch.zeros(shape, dtype=dtype, device=dev)
        return list(full.unbind(0))
    if dev.type != "cpu":
        raise ValueError(f"device {dev} is not supported (cpu or cuda)")
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    seg = Segment.create(nbytes)
    flat = seg.as_tensor()
    with _SEGMENTS_LOCK:
        _SEGMENTS[seg.name] = (seg, flat.data_ptr())
    full = flat.view(dtype).view(shape)
    return list(full.unbind(0))


def free_kv_caches(caches: Sequence[torch.Tensor]) -> None:
    """Unlink the segments behind ``caches`` (mappings stay valid until the tensors die).
    Segments already unlinked (by ``WorkerAdapter.close``) are skipped."""
    names = set()
    for t in caches:
        if t.device.type == "cpu":
            with contextlib.suppress(ValueError):
                names.add(_segment_of(t)[0].name)
    for name in names:
        with _SEGMENTS_LOCK:
            entry = _SEGMENTS.pop(name, None)
        if entry is not None:
            entry[0].unlink()


def _segment_of(t: torch.Tensor) -> tuple[Segment, int]:
    ptr = t.data_ptr()
    with _SEGMENTS_LOCK:
        for seg, base in _SEGMENTS.values():
            if base <= ptr < base + seg.size:
                return seg, ptr - base
    raise ValueError("tensor is not backed by shared memory from allocate_kv_caches()")


def _layout(caches: Sequence[torch.Tensor]) -> tuple[str, str, list[int], list[list[Any]]]:
    if not caches:
        raise ValueError("no KV cache tensors")
    first = caches[0]
    shape = list(first.shape)
    if len(shape) != 5 or shape[0] != 2:
        raise ValueError(f"KV tensors must be [2, num_blocks, block_size, heads, head_dim], got {shape}")
    for i, t in enumerate(caches):
        if list(t.shape) != shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(f"layer {i}: shape/dtype/device differ from layer 0")
        if not t.is_contiguous():
            raise ValueError(f"layer {i}: tensor is not contiguous")
    strides = list(first.stride())
    item = first.element_size()
    layers: list[list[Any]] = []
    if first.device.type == "cuda":
        memory = "cuda_ipc"
        for t in caches:
            st = t.untyped_storage()
            dev, handle, size, off, rc_h, rc_off, ev_h, ev_sync = st._share_cuda_()  # type: ignore[attr-defined,no-untyped-call]
            uuid_s = str(torch.cuda.get_device_properties(dev).uuid)
            layers.append([uuid_s, int(dev), bytes(handle), int(size), int(off),
                           t.storage_offset() * item, bytes(rc_h), int(rc_off), bytes(ev_h or b""),
                           bool(ev_sync), strides])
    else:
        memory = "shm"
        for t in caches:
            seg, offset = _segment_of(t)
            layers.append([seg.name, offset, strides])
    return memory, DTYPE_NAMES[first.dtype], shape, layers


def unlink_segments(names: Sequence[str]) -> None:
    """Unlink segments this process made (the adapter's close); unknown names are skipped."""
    for name in names:
        with _SEGMENTS_LOCK:
            entry = _SEGMENTS.pop(name, None)
        if entry is not None:
            entry[0].unlink()
