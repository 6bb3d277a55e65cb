"""Worker-side KV memory: ``allocate_kv_caches`` and the layout a REGISTER describes.

On CPU all layers live in one shared-memory segment (see `dataplane.memory.shm` for who unlinks it
and when); on CUDA they are ordinary device tensors shared through CUDA IPC handles.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dataplane.memory.kvmemory import DTYPE_NAMES
from dataplane.memory.shm import Segment
from dataplane.wire.messages import CudaLayer, Layer, MemoryKind, ShmLayer

# segments made by allocate_kv_caches in this process: name -> (segment, base address)
_SEGMENTS: dict[str, tuple[Segment, int]] = {}
_SEGMENTS_LOCK = threading.Lock()  # guards _SEGMENTS


def _unlink_all_at_exit() -> None:
    with _SEGMENTS_LOCK:
        for seg, _ in _SEGMENTS.values():
            seg.unlink()
        _SEGMENTS.clear()


atexit.register(_unlink_all_at_exit)


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
) -> list[torch.Tensor]:
    """One ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer.

    On CPU all layers live in one shared-memory segment the server maps (zero-filled);
    on CUDA they are ordinary device tensors shared through CUDA IPC at registration.
    """
    for name, v in (
        ("num_layers", num_layers),
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
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
                names.add(_segment_of(t)[0])
    for name in names:
        with _SEGMENTS_LOCK:
            entry = _SEGMENTS.pop(name, None)
        if entry is not None:
            entry[0].unlink()


def _segment_of(t: torch.Tensor) -> tuple[str, int]:
    ptr = t.data_ptr()
    with _SEGMENTS_LOCK:
        for seg, base in _SEGMENTS.values():
            if base <= ptr < base + seg.size:
                return seg.name, ptr - base
    raise ValueError("tensor is not backed by shared memory from allocate_kv_caches()")


@dataclass(frozen=True)
class CacheLayout:
    """What a REGISTER says of a worker's per-layer KV tensors."""

    memory: MemoryKind
    dtype: str
    kv_shape: tuple[int, ...]  # [2, num_blocks, block_size, heads, head_dim]
    layers: tuple[Layer, ...]

    @property
    def segments(self) -> list[str]:
        """The shared-memory segments the layers live in (none on CUDA)."""
        return list(dict.fromkeys(lay.segment for lay in self.layers if isinstance(lay, ShmLayer)))


def describe_caches(caches: Sequence[torch.Tensor]) -> CacheLayout:
    """The layout of ``caches`` as a REGISTER carries it (ValueError when it is not one)."""
    if not caches:
        raise ValueError("no KV cache tensors")
    first = caches[0]
    shape = tuple(first.shape)
    if len(shape) != 5 or shape[0] != 2:
        raise ValueError(
            f"KV tensors must be [2, num_blocks, block_size, heads, head_dim], got {list(shape)}"
        )
    for i, t in enumerate(caches):
        if tuple(t.shape) != shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(f"layer {i}: shape/dtype/device differ from layer 0")
        if not t.is_contiguous():
            raise ValueError(f"layer {i}: tensor is not contiguous")
    strides = tuple(first.stride())
    if first.device.type == "cuda":
        layers: tuple[Layer, ...] = tuple(_cuda_layer(t, strides) for t in caches)
        memory = MemoryKind.CUDA_IPC
    else:
        layers = tuple(ShmLayer(*_segment_of(t), strides) for t in caches)
        memory = MemoryKind.SHM
    return CacheLayout(memory, DTYPE_NAMES[first.dtype], shape, layers)


def _cuda_layer(t: torch.Tensor, strides: tuple[int, ...]) -> CudaLayer:
    st = t.untyped_storage()
    dev, handle, size, off, rc_h, rc_off, ev_h, ev_sync = st._share_cuda_()  # type: ignore[attr-defined,no-untyped-call]
    uuid_s = str(torch.cuda.get_device_properties(dev).uuid)
    return CudaLayer(
        uuid_s,
        int(dev),
        bytes(handle),
        int(size),
        int(off),
        int(t.storage_offset()) * t.element_size(),
        bytes(rc_h),
        int(rc_off),
        bytes(ev_h or b""),
        bool(ev_sync),
        strides,
    )


def unlink_segments(names: Sequence[str]) -> None:
    """Unlink segments this process made (the adapter's close); unknown names are skipped."""
    for name in names:
        with _SEGMENTS_LOCK:
            entry = _SEGMENTS.pop(name, None)
        if entry is not None:
            entry[0].unlink()
